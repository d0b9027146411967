"""Per-row FP8 (e4m3) activation quantization: `quantize_rows(x)` -> (values, per-row float32 scales)."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant import reference


def quantize_rows(x):
    """`(M, K)` -> (`(M, K)` e4m3, `(M, 1)` float32). Triton on CUDA (one pass), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast

        return fast.quantize_rows(x)
    return reference.quantize_rows(x)
