"""FP8 (e4m3) activation quantization: `quantize_rows(x)` -> `Fp8Rows` (values, per-row float32 scales) for FP8
GEMMs, `quantize_heads(x)` -> (values, per-(batch, head) descales) for FP8 attention."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant import reference
from h3gen.kernels.fp8_quant.reference import FP8, FP8_MAX, Fp8Rows

__all__ = ["FP8", "FP8_MAX", "Fp8Rows", "quantize_heads", "quantize_rows"]


def quantize_rows(x):
    """`(M, K)` -> `Fp8Rows` (`(M, K)` e4m3, `(M, 1)` float32). Triton on CUDA (one pass), the torch reference
    elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        return fast.quantize_rows(x)
    return reference.quantize_rows(x)


def quantize_heads(x):
    """`(B, S, H, D)` -> (e4m3 `(B, S, H, D)`, `(B, H)` float32 descales). Triton on CUDA (an amax pass and a
    quantizing pass), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        return fast.quantize_heads(x)
    return reference.quantize_heads(x)
