"""MoE ops: `route_topk` (sigmoid + correction bias, grouped top-k, renormalise, scale), `sort_by_expert`, the
grouped expert GEMMs `grouped_gemm` (dense) / `grouped_mxfp4_gemm` (MXFP4 weights), and `expert_gemv` (a few
rows, each through its own expert of a stacked weight, with no host synchronisation: the decode path, CUDA-graph
safe).

`expert_gemv` and `route_topk` (without expert groups) take their Triton kernels on CUDA; the others are torch
references on every device."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.moe import reference
from h3gen.kernels.moe.reference import grouped_gemm, grouped_mxfp4_gemm, sort_by_expert


def route_topk(logits, correction_bias, top_k, num_groups=1, topk_groups=1, renormalize=True, scaling=1.0):
    """`logits` `[T, E]` -> (weights `[T, top_k]` float32, expert ids `[T, top_k]` int64); see
    `reference.route_topk`. Without expert groups on CUDA, one Triton program per token."""
    if num_groups <= 1 and use_triton(logits) and logits.shape[-1] <= 1024:
        from h3gen.kernels.moe import triton as fast

        return fast.route_topk(logits, correction_bias, top_k, renormalize, scaling)
    return reference.route_topk(logits, correction_bias, top_k, num_groups, topk_groups, renormalize, scaling)


def expert_gemv(x, weight, ids):
    """`x` `[P, K]`, `weight` `[E, N, K]`, `ids` `[P]` -> `[P, N]`: row p through expert `ids[p]`."""
    if use_triton(x):
        from h3gen.kernels.moe import triton as fast

        return fast.expert_gemv(x, weight, ids)
    return reference.expert_gemv(x, weight, ids)


def expert_gemv_mxfp4(x, packed, scales, ids):
    """`expert_gemv` for MXFP4 experts: `packed` `[E, N, Kp / 2]`, `scales` `[E, N, Kp / 32]` -> `[P, N]`."""
    if use_triton(x):
        from h3gen.kernels.moe import triton as fast

        return fast.expert_gemv_mxfp4(x, packed, scales, ids)
    return reference.expert_gemv_mxfp4(x, packed, scales, ids)


def stacked_experts(h, up_gate, down, ids, activation, swiglu: bool):
    """`h` `[T, W]` through the experts `ids` `[T, k]` picks (stacked `up_gate` `[E, 2I, W]`, `down` `[E, W, I]`) ->
    `[T * k, W]` in pair order. On CUDA with `swiglu` (the activation is silu(gate) * up) the Triton grouped GEMMs
    run with no host synchronisation (pairs grouped into expert blocks on the device, SwiGLU fused into the first
    GEMM); otherwise the torch reference with `activation(gate, up)`."""
    if swiglu and use_triton(h):
        from h3gen.kernels.moe import triton as fast

        pairs = ids.reshape(-1)
        rows, block_expert = fast.moe_blocks(pairs, up_gate.shape[0], 64)
        act = fast.grouped_expert_gemm(h, up_gate, rows, block_expert, pairs.numel(), ids.shape[1], swiglu=True)
        return fast.grouped_expert_gemm(act, down, rows, block_expert, pairs.numel(), 1)
    return reference.stacked_experts(h, up_gate, down, ids, activation)


__all__ = ["expert_gemv", "expert_gemv_mxfp4", "grouped_gemm", "grouped_mxfp4_gemm", "route_topk", "sort_by_expert", "stacked_experts"]
