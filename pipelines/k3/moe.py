"""How a K3 MoE layer runs its routed experts: the expert modules, the router, and four ways of computing
`sum_k w_k E_{ids_k}(h)` that `K3MoE` (in `model.py`) picks between by batch size and weight format.

    grouped_by_expert   tokens sorted by expert, one grouped GEMM per projection (experts not stacked)
    stacked_blocks      pairs grouped into blocks per expert over stacked weights (prefill with stacked experts)
    per_pair            one GEMV per (token, expert) pair over stacked dense weights (decode batches)
    per_pair_mxfp4      the same over stacked MXFP4 bytes and scales

Every function takes `h` `[T, W]` (the expert input width), router `weights` `[T, k]` float32 and expert `ids`
`[T, k]` int64, and returns `[T, W]` in `h`'s dtype.
"""

from typing import Callable

import torch
import torch.nn as nn

from h3gen.kernels.moe import (
    expert_gemv,
    expert_gemv_mxfp4,
    expert_swiglu_down,
    expert_swiglu_down_mxfp4,
    grouped_gemm,
    grouped_mxfp4_gemm,
    router_topk,
    sort_by_expert,
    stacked_experts,
)
from h3gen.kernels.mxfp4_gemm import dequantize_weight
from h3gen.linear import LinearFactory, LinearSpec
from h3gen.pipelines.k3.config import K3Config

# Up to this many (token, expert) pairs a MoE layer with stacked experts runs one expert GEMV per pair (decode
# batches of a few sequences); beyond, pairs are grouped into blocks per expert (`stacked_experts`), so each
# expert's matrix is read once per block instead of once per pair. On the H200 per-pair GEMVs won at 8 sequences x
# top-6 (48 pairs), grouping at 32 x 6 (192 pairs).
DEVICE_ROUTING_MAX_PAIRS = 64
# MXFP4 experts have no grouped device kernel: decode batches of up to this many pairs go per pair (a whole CUDA
# graph needs that), larger (prefill) batches through the per-expert loop.
MXFP4_DEVICE_ROUTING_MAX_PAIRS = 512

# (gate, up) -> act(gate) * up in the experts' activation (SiLU or SiTU; see `model.gated_activation`).
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class K3Expert(nn.Module):
    """One routed expert, named as in the checkpoint: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, intermediate: int, linear: LinearFactory):
        super().__init__()
        self.w1 = linear(LinearSpec(hidden, intermediate, False, "column", "moe.expert"))
        self.w3 = linear(LinearSpec(hidden, intermediate, False, "column", "moe.expert"))
        self.w2 = linear(LinearSpec(intermediate, hidden, False, "row", "moe.expert"))


class K3Router(nn.Module):
    """Sigmoid router over the full-width token (float32 logits), `e_score_correction_bias` for selection."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor, always: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[T, D]` -> (weights `[T, k + always]` float32, expert ids `[T, k + always]`); `always` appends
        always-on experts E, E + 1, ... with weight 1 (see `K3MoE.stack_experts`)."""
        return router_topk(x, self.weight, *self._routing(always))

    def after_residual(self, h: torch.Tensor, delta: torch.Tensor, norm: nn.Module, always: int = 0):
        """The residual update, the RMSNorm `norm` after it and this router in one op: (`h + delta`, its norm,
        weights, ids), rounded as `add_rms_norm` then `forward` (one kernel for decode batches, see `router_topk`)."""
        return router_topk(h, self.weight, *self._routing(always), residual=(delta, norm.weight, norm.eps))

    def _routing(self, always: int) -> tuple:
        c = self.config
        return (
            self.e_score_correction_bias,
            c.num_experts_per_token,
            c.num_expert_group,
            c.topk_group,
            c.moe_renormalize,
            c.routed_scaling_factor,
            always,
        )


def stack_weights(
    experts: list[K3Expert], name: str, shared: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each expert's tensor `name` (`"weight"`, or an MXFP4 layer's `"weight_packed"` / `"weight_scale"`) into
    stacked `up_gate` `[E, 2I, W]` (w3 over w1) and `down` `[E, W, I]`, and point the experts' tensors at their
    views (state-dict keys and values do not change). `shared` (an MLP with `up_proj`, `gate_proj`, `down_proj`)
    becomes stacked expert E, its fused [up; gate] kept as `shared.fused_in`."""
    first = experts[0]
    inter = getattr(first.w1, name).shape[0]
    count = len(experts) + (shared is not None)
    up_gate = getattr(first.w1, name).new_empty(count, 2 * inter, getattr(first.w1, name).shape[1])
    down = getattr(first.w2, name).new_empty(count, *getattr(first.w2, name).shape)
    for e, expert in enumerate(experts):
        for layer, view in ((expert.w3, up_gate[e, :inter]), (expert.w1, up_gate[e, inter:]), (expert.w2, down[e])):
            view.copy_(getattr(layer, name))
            if name == "weight":
                layer.weight.data = view
            else:
                setattr(layer, name, view)  # a buffer: re-registered as the view
    if shared is not None:
        e = len(experts)
        for layer, view in (
            (shared.up_proj, up_gate[e, :inter]),
            (shared.gate_proj, up_gate[e, inter:]),
            (shared.down_proj, down[e]),
        ):
            view.copy_(layer.weight)
            layer.weight.data = view
        shared.fused_in = up_gate[e]
    return up_gate, down


def _grouped(x: torch.Tensor, offsets: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
    """The grouped GEMM kernel matching how the experts store their weights (MXFP4 or dense)."""
    if all(hasattr(layer, "weight_packed") for layer in layers):
        out = grouped_mxfp4_gemm(
            x.to(layers[0].compute_dtype),
            offsets,
            [layer.weight_packed for layer in layers],
            [layer.weight_scale for layer in layers],
        )
        return out.to(x.dtype)
    return grouped_gemm(x, offsets, [layer.weight for layer in layers])


def grouped_by_expert(
    h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list[K3Expert], activation: Activation
) -> torch.Tensor:
    """Tokens sorted by expert, then one grouped GEMM per projection over the experts' own weights."""
    top_k = ids.shape[1]
    order, offsets = sort_by_expert(ids, len(experts))
    tokens = order // top_k
    rows = h[tokens]
    gate = _grouped(rows, offsets, [e.w1 for e in experts])
    up = _grouped(rows, offsets, [e.w3 for e in experts])
    down = _grouped(activation(gate, up), offsets, [e.w2 for e in experts])
    scaled = down * weights.reshape(-1)[order, None].to(down.dtype)
    return torch.zeros_like(h).index_add_(0, tokens, scaled)


def stacked_blocks(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up_gate: torch.Tensor,
    down: torch.Tensor,
    activation: Activation,
    swiglu: bool,
) -> torch.Tensor:
    """Pairs grouped into blocks per expert over stacked `up_gate` `[E, 2I, W]` and `down` `[E, W, I]`, on the
    device (no host synchronisation); `swiglu` says the activation is SiLU's."""
    out = stacked_experts(h, up_gate, down, ids, activation, swiglu=swiglu)
    return (out.view(*ids.shape, -1) * weights[..., None].to(out.dtype)).sum(dim=1)


def widened_mxfp4(stacked_mxfp4: tuple, dtype: torch.dtype, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked MXFP4 experts (`((packed, scales) of up_gate, (packed, scales) of down)`) in `dtype`: `up_gate`
    `[E, 2I, W]` and `down` `[E, W, I]`, a temporary copy for one call (one dequantizing pass)."""
    (packed_up_gate, scales_up_gate), (packed_down, scales_down) = stacked_mxfp4
    experts, inter2, _ = packed_up_gate.shape
    up_gate = dequantize_weight(
        packed_up_gate.reshape(experts * inter2, -1), scales_up_gate.reshape(experts * inter2, -1), dtype, width
    )
    down = dequantize_weight(
        packed_down.reshape(experts * width, -1), scales_down.reshape(experts * width, -1), dtype, inter2 // 2
    )
    return up_gate.view(experts, inter2, width), down.view(experts, width, inter2 // 2)


def per_pair(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up_gate: torch.Tensor,
    down: torch.Tensor,
    activation: Activation,
    swiglu: bool,
    always: int = 0,
) -> torch.Tensor:
    """Each (token, slot) pair through its stacked dense expert by GEMVs (the last `always` slots are always-on
    experts whose weights load before the routing is known); with SwiGLU experts the activation, the down experts
    and the weighted slot sum are one kernel."""
    tokens, top_k = ids.shape
    pairs = ids.reshape(-1)
    both = expert_gemv(h, up_gate, pairs, top_k, always)  # [T * k, 2I]: [up; gate]
    if swiglu:
        return expert_swiglu_down(both, down, ids, weights).to(h.dtype)
    inter = down.shape[-1]
    out = expert_gemv(activation(both[:, inter:], both[:, :inter]), down, pairs)
    return (out.to(h.dtype).view(tokens, top_k, -1) * weights[..., None].to(h.dtype)).sum(dim=1)


def per_pair_mxfp4(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    stacked_mxfp4: tuple,
    compute_dtype: torch.dtype,
    activation: Activation,
    swiglu: bool,
) -> torch.Tensor:
    """`per_pair` over stacked MXFP4 experts, decoding the packed bytes inside the GEMVs (`h` runs in
    `compute_dtype`)."""
    tokens, top_k = ids.shape
    pairs = ids.reshape(-1)
    (packed_up_gate, scales_up_gate), (packed_down, scales_down) = stacked_mxfp4
    both = expert_gemv_mxfp4(h.to(compute_dtype), packed_up_gate, scales_up_gate, pairs, top_k)
    if swiglu:
        return expert_swiglu_down_mxfp4(both, packed_down, scales_down, ids, weights).to(h.dtype)
    inter = both.shape[-1] // 2
    out = expert_gemv_mxfp4(activation(both[:, inter:], both[:, :inter]), packed_down, scales_down, pairs)
    return (out.to(h.dtype).view(tokens, top_k, -1) * weights[..., None].to(h.dtype)).sum(dim=1)
