"""MoE routing and the grouped expert GEMMs in plain torch.

Routing (DeepSeek-V3 / Kimi "noaux_tc"): sigmoid scores, selection on scores + correction bias (optionally within
the best groups), weights from the plain scores, renormalised, times the routed scaling factor. The grouped GEMMs
take the tokens sorted by expert (`sort_by_expert`) and one weight per expert, dense or MXFP4.
"""

import torch

from h3gen.kernels.swiglu.reference import swiglu
from h3gen.quant.mxfp4_format import dequantize


def route_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    always: int = 0,
):
    """`logits` `[T, E]` -> (weights `[T, top_k + always]` float32, expert ids `[T, top_k + always]` int64).

    Groups are ranked by the sum of their two best biased scores; only the `topk_groups` best take part. `always`
    appends that many always-on experts, ids E .. E + always - 1 with weight 1 (shared experts stacked after the
    routed ones)."""
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if always:
        extra = torch.arange(logits.shape[-1], logits.shape[-1] + always, device=ids.device).expand(ids.shape[0], -1)
        ids = torch.cat([ids, extra], dim=1)
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], always)], dim=1)
    return weights, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """`ids` `[T, k]` -> (`order` `[T * k]`: flat (token, slot) indices grouped by expert, stable;
    `offsets` `[E + 1]`: expert e owns `order[offsets[e]:offsets[e + 1]]`)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = counts.cumsum(0)
    return order, offsets


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, weights) -> torch.Tensor:
    """Rows `x[offsets[e]:offsets[e + 1]]` times `weights[e]^T` (`[N, K]` each) -> `[M, N]` in x.dtype."""
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    for e in range(len(offsets) - 1):
        start, stop = int(offsets[e]), int(offsets[e + 1])
        if stop > start:
            out[start:stop] = (x[start:stop].float() @ weights[e].float().t()).to(x.dtype)
    return out


def grouped_mxfp4_gemm(x: torch.Tensor, offsets: torch.Tensor, packed, scales) -> torch.Tensor:
    """As `grouped_gemm` with MXFP4 weights: `packed[e]` `[N, Kp / 2]` uint8, `scales[e]` `[N, Kp / 32]` uint8
    (stacked tensors or per-expert lists). Float32 accumulation, output in x.dtype."""
    out = x.new_empty(x.shape[0], packed[0].shape[0])
    for e in range(len(offsets) - 1):
        start, stop = int(offsets[e]), int(offsets[e + 1])
        if stop > start:
            weight = dequantize(packed[e], scales[e], torch.float32, in_features=x.shape[-1])
            out[start:stop] = (x[start:stop].float() @ weight.t()).to(x.dtype)
    return out


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, top_k: int = 1) -> torch.Tensor:
    """Pair p (row `p // top_k` of `x` `[P / top_k, K]`) times `weight[ids[p]]^T` (`weight` `[E, N, K]` stacked
    experts, `ids` `[P]` int) -> `[P, N]` in x.dtype, float32 accumulation. No host synchronisation (CUDA-graph
    safe); reads one expert matrix per pair, so it is meant for the few tokens of a decode step."""
    x = x.repeat_interleave(top_k, dim=0)
    return (weight[ids].float() @ x.float()[:, :, None]).squeeze(-1).to(x.dtype)


def expert_swiglu_down(
    both: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """The end of a decode step's routed experts: `both` `[T * k, 2I]` ([up; gate] per (token, slot) pair, from
    `expert_gemv`), SwiGLU rounded to `both.dtype` as the separate op would, through the pair's `down` expert
    (`down` `[E, W, I]`, `ids` `[T, k]`), weighted by `weights` `[T, k]` and summed over the k slots in float32
    (plus `add` `[T, W]` when given, before the one rounding) -> `[T, W]` in `both.dtype`."""
    tokens, top_k = ids.shape
    act = swiglu(both).float()
    out = (down[ids.reshape(-1)].float() @ act[:, :, None]).squeeze(-1).view(tokens, top_k, -1)
    total = (out * weights[..., None].float()).sum(dim=1)
    return (total if add is None else total + add.float()).to(both.dtype)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `[T, D]` times the router `weight` `[E, D]` transposed -> `[T, E]` float32 (float32 inputs and math)."""
    return x.float() @ weight.float().t()


def stacked_experts(
    h: torch.Tensor, up_gate: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, activation
) -> torch.Tensor:
    """Every (token, slot) pair through its expert: `h` `[T, W]`, `up_gate` `[E, 2I, W]` ([up; gate] rows), `down`
    `[E, W, I]`, `ids` `[T, k]`, `activation(gate, up)` -> `[T * k, W]` in pair order (token-major), tokens grouped
    by expert for the GEMMs."""
    top_k, inter = ids.shape[1], down.shape[-1]
    order, offsets = sort_by_expert(ids, up_gate.shape[0])
    both = grouped_gemm(h[order // top_k], offsets, list(up_gate))
    out = grouped_gemm(activation(both[:, inter:], both[:, :inter]), offsets, list(down))
    return torch.empty_like(out).index_copy_(0, order, out)


def expert_gemv_mxfp4(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, top_k: int = 1
) -> torch.Tensor:
    """`expert_gemv` with MXFP4 experts: pair p (row `p // top_k` of `x` `[P / top_k, K]`) times expert `ids[p]`
    (`packed` `[E, N, Kp / 2]` uint8, `scales` `[E, N, Kp / 32]` uint8, `Kp` the input width padded to 32, K <= Kp)
    -> `[P, N]` in x.dtype, float32 math."""
    out = x.new_empty(ids.numel(), packed.shape[1])
    for pair in range(ids.numel()):
        expert = int(ids[pair])
        weight = dequantize(packed[expert], scales[expert], torch.float32, in_features=x.shape[-1])
        out[pair] = (weight @ x[pair // top_k].float()).to(x.dtype)
    return out


def expert_swiglu_down_mxfp4(
    both: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """`expert_swiglu_down` with MXFP4 down experts (`packed` `[E, W, Ip / 2]`, `scales` `[E, W, Ip / 32]`)."""
    tokens, top_k = ids.shape
    act = swiglu(both).float()
    out = torch.zeros(tokens, packed.shape[1], dtype=torch.float32, device=both.device)
    for pair in range(ids.numel()):
        expert = int(ids.reshape(-1)[pair])
        weight = dequantize(packed[expert], scales[expert], torch.float32, in_features=act.shape[-1])
        out[pair // top_k] += weights.reshape(-1)[pair].float() * (weight @ act[pair])
    return out.to(both.dtype)
