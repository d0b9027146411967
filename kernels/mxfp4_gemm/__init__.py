"""GEMM with MXFP4 weights: `mxfp4_matmul(x, packed, scales)`; Triton on CUDA, the torch reference elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.mxfp4_gemm import reference


def mxfp4_matmul(x, packed, scales):
    """`x` `[M, K]` @ dequantized `[N, K]`^T -> `[M, N]` in x.dtype (float32 accumulation)."""
    if use_triton(x):
        from h3gen.kernels.mxfp4_gemm import triton as fast

        return fast.mxfp4_matmul(x, packed, scales)
    return reference.mxfp4_matmul(x, packed, scales)
