"""The MoE kernels in Triton, one module per family: `triton_routing` (router logits, top-k, the fused router),
`triton_experts` (dense expert GEMVs for decode, the grouped expert GEMM for prefill), `triton_mxfp4` (the
MXFP4-expert decode kernels). This module gathers their public functions."""

from h3gen.kernels.moe.triton_experts import expert_gemv, expert_swiglu_down, grouped_expert_gemm, moe_blocks
from h3gen.kernels.moe.triton_mxfp4 import expert_gemv_mxfp4, expert_swiglu_down_mxfp4
from h3gen.kernels.moe.triton_routing import route_topk, router_logits, router_topk

__all__ = [
    "expert_gemv",
    "expert_gemv_mxfp4",
    "expert_swiglu_down",
    "expert_swiglu_down_mxfp4",
    "grouped_expert_gemm",
    "moe_blocks",
    "route_topk",
    "router_logits",
    "router_topk",
]
