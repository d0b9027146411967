"""GEMM with MXFP4 weights: `mxfp4_matmul(x, packed, scales)`, and the weights themselves widened back:
`dequantize_weight(packed, scales, dtype, in_features)`. Triton on CUDA, the torch reference elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.mxfp4_gemm import reference
from h3gen.quant.mxfp4_format import dequantize


def mxfp4_matmul(x, packed, scales):
    """`x` `[M, K]` @ dequantized `[N, K]`^T -> `[M, N]` in x.dtype (float32 accumulation)."""
    if use_triton(x):
        from h3gen.kernels.mxfp4_gemm import triton as fast  # on first use: see _dispatch

        return fast.mxfp4_matmul(x, packed, scales)
    return reference.mxfp4_matmul(x, packed, scales)


def dequantize_weight(packed, scales, dtype, in_features):
    """(`[N, Kp / 2]` uint8, `[N, Kp / 32]` uint8) -> `[N, in_features]` in `dtype` (one pass on CUDA)."""
    if use_triton(packed):
        from h3gen.kernels.mxfp4_gemm import triton_decode as fast  # on first use: see _dispatch

        return fast.dequantize(packed, scales, dtype, in_features)
    return dequantize(packed, scales, dtype, in_features)
