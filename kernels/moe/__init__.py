"""MoE ops: `route_topk` (sigmoid + correction bias, grouped top-k, renormalise, scale), `sort_by_expert`, the
grouped expert GEMMs `grouped_gemm` (dense) / `grouped_mxfp4_gemm` (MXFP4 weights), and for the few tokens of a
decode step with no host synchronisation (CUDA-graph safe): `router_logits`, `router_topk` (the router and the
top-k, optionally after the residual update and norm, in one kernel), `expert_gemv` (each (token, slot) pair
through its own expert of a stacked weight) and `expert_swiglu_down` (SwiGLU, down experts and the weighted sum).

Those, their MXFP4-expert twins `expert_gemv_mxfp4` and `expert_swiglu_down_mxfp4`, `stacked_experts` and
`route_topk` (without expert groups) take their Triton kernels on CUDA; the others are torch references on every
device."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.moe import reference
from h3gen.kernels.moe.reference import grouped_gemm, grouped_mxfp4_gemm, sort_by_expert
from h3gen.kernels.rmsnorm import add_rms_norm


def route_topk(logits, correction_bias, top_k, num_groups=1, topk_groups=1, renormalize=True, scaling=1.0, always=0):
    """`logits` `[T, E]` -> (weights `[T, top_k + always]` float32, expert ids `[T, top_k + always]` int64); see
    `reference.route_topk` (`always`: always-on experts E .. E + always - 1 appended with weight 1). Without expert
    groups on CUDA, one Triton program per token."""
    if num_groups <= 1 and use_triton(logits) and logits.shape[-1] <= 1024:
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.route_topk(logits, correction_bias, top_k, renormalize, scaling, always)
    return reference.route_topk(logits, correction_bias, top_k, num_groups, topk_groups, renormalize, scaling, always)


ROUTER_TOPK_MAX_TOKENS = 16  # one program per token and expert, each norming the row: for decode batches


def router_topk(
    x,
    weight,
    correction_bias,
    top_k,
    num_groups=1,
    topk_groups=1,
    renormalize=True,
    scaling=1.0,
    always=0,
    residual=None,
):
    """`route_topk(router_logits(x, weight), ...)`: `x` `[T, D]` -> (weights `[T, top_k + always]` float32, ids
    `[T, top_k + always]` int64). With `residual` = (delta, norm weight, eps) the router reads
    `rms_norm(x + delta)` and the call returns (total, normed, weights, ids) as `add_rms_norm` then the router
    would. One Triton kernel on CUDA without expert groups for up to `ROUTER_TOPK_MAX_TOKENS` tokens."""
    if num_groups <= 1 and use_triton(x) and 0 < x.shape[0] <= ROUTER_TOPK_MAX_TOKENS and weight.shape[0] <= 1024:
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.router_topk(x, weight, correction_bias, top_k, renormalize, scaling, always, residual)
    total = normed = None
    if residual is not None:
        delta, norm_weight, eps = residual
        total, normed = add_rms_norm(x, delta, norm_weight, eps)
        x = normed
    weights, ids = route_topk(
        router_logits(x, weight), correction_bias, top_k, num_groups, topk_groups, renormalize, scaling, always
    )
    return (total, normed, weights, ids) if residual is not None else (weights, ids)


def expert_gemv(x, weight, ids, top_k=1, always=0):
    """`x` `[P / top_k, K]`, `weight` `[E, N, K]`, `ids` `[P]` -> `[P, N]`: pair p (row `p // top_k` of x) through
    expert `ids[p]`. `always`: the last that many slots of each token hold the always-on experts E - always ..
    E - 1 (their ids say so too); the Triton kernel then loads their weights before the routing is known."""
    if use_triton(x):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.expert_gemv(x, weight, ids, top_k, always=always)
    return reference.expert_gemv(x, weight, ids, top_k)


def expert_swiglu_down(both, down, ids, weights, add=None):
    """`both` `[T * k, 2I]` ([up; gate] per pair), `down` `[E, W, I]`, `ids` and `weights` `[T, k]` -> `[T, W]`:
    SwiGLU, each pair's down expert and the weighted sum over slots, plus `add` `[T, W]` when given (one Triton
    kernel on CUDA)."""
    if use_triton(both):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.expert_swiglu_down(both, down, ids, weights, add=add)
    return reference.expert_swiglu_down(both, down, ids, weights, add)


def router_logits(x, weight):
    """`x` `[T, D]`, router `weight` `[E, D]` -> `[T, E]` float32 logits (one Triton kernel on CUDA, no casts)."""
    if use_triton(x):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.router_logits(x, weight)
    return reference.router_logits(x, weight)


def expert_gemv_mxfp4(x, packed, scales, ids, top_k=1):
    """`expert_gemv` for MXFP4 experts: `packed` `[E, N, Kp / 2]`, `scales` `[E, N, Kp / 32]` -> `[P, N]`."""
    if use_triton(x):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.expert_gemv_mxfp4(x, packed, scales, ids, top_k)
    return reference.expert_gemv_mxfp4(x, packed, scales, ids, top_k)


def expert_swiglu_down_mxfp4(both, packed, scales, ids, weights):
    """`expert_swiglu_down` for MXFP4 down experts: `packed` `[E, W, Ip / 2]`, `scales` `[E, W, Ip / 32]` ->
    `[T, W]` (one Triton kernel on CUDA)."""
    if use_triton(both):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        return fast.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)
    return reference.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)


def stacked_experts(h, up_gate, down, ids, activation, swiglu: bool):
    """`h` `[T, W]` through the experts `ids` `[T, k]` picks (stacked `up_gate` `[E, 2I, W]`, `down` `[E, W, I]`) ->
    `[T * k, W]` in pair order. On CUDA with `swiglu` (the activation is silu(gate) * up) the Triton grouped GEMMs
    run with no host synchronisation (pairs grouped into expert blocks on the device, SwiGLU fused into the first
    GEMM); otherwise the torch reference with `activation(gate, up)`."""
    if swiglu and use_triton(h):
        from h3gen.kernels.moe import triton as fast  # on first use: see _dispatch

        pairs = ids.reshape(-1)
        rows, block_expert = fast.moe_blocks(pairs, up_gate.shape[0], 64)
        act = fast.grouped_expert_gemm(h, up_gate, rows, block_expert, pairs.numel(), ids.shape[1], swiglu=True)
        return fast.grouped_expert_gemm(act, down, rows, block_expert, pairs.numel(), 1)
    return reference.stacked_experts(h, up_gate, down, ids, activation)


__all__ = [
    "expert_gemv",
    "expert_gemv_mxfp4",
    "expert_swiglu_down",
    "expert_swiglu_down_mxfp4",
    "grouped_gemm",
    "grouped_mxfp4_gemm",
    "route_topk",
    "router_logits",
    "router_topk",
    "sort_by_expert",
    "stacked_experts",
]
