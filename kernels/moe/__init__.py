"""MoE ops: `route_topk` (sigmoid + correction bias, grouped top-k, renormalise, scale), `sort_by_expert`, and the
grouped expert GEMMs `grouped_gemm` (dense) / `grouped_mxfp4_gemm` (MXFP4 weights).

Only the torch references exist so far; they run on every device."""

from h3gen.kernels.moe.reference import grouped_gemm, grouped_mxfp4_gemm, route_topk, sort_by_expert

__all__ = ["grouped_gemm", "grouped_mxfp4_gemm", "route_topk", "sort_by_expert"]
