"""MXFP4-weight GEMM in plain torch: dequantize the weight, then one matmul."""

import torch

from h3gen.quant.mxfp4_format import dequantize


def mxfp4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x` `[M, K]` (K <= Kp) times the dequantized `[N, Kp]` weight, transposed -> `[M, N]` in x.dtype, with
    float32 accumulation."""
    weight = dequantize(packed, scales, torch.float32, in_features=x.shape[-1])
    return (x.float() @ weight.t()).to(x.dtype)
