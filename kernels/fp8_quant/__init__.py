"""FP8 (e4m3) activation quantization: `quantize_rows(x)` -> `Fp8Rows` (values, per-row float32 scales) for FP8
GEMMs, `quantize_heads(x)` -> (values, per-(batch, head) descales) for FP8 attention, `head_descales(x)` those
descales alone."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant import reference
from h3gen.kernels.fp8_quant.reference import FP8, FP8_MAX, Fp8Rows

__all__ = ["FP8", "FP8_MAX", "Fp8Rows", "append_scaled_columns", "head_descales", "quantize_heads", "quantize_rows"]


def quantize_rows(x, out=None):
    """`(M, K)` -> `Fp8Rows` (`(M, K)` e4m3, `(M, 1)` float32); `out` (optional `Fp8Rows`, its values' rows possibly
    strided: columns of a wider buffer) receives it. Triton on CUDA (one pass), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        return fast.quantize_rows(x, out=out)
    result = reference.quantize_rows(x)
    return result if out is None else reference.copy_rows(out, result)


def append_scaled_columns(values, scale, projected, factors):
    """Fill the last columns of e4m3 rows `values` `(M, K + R)` with `projected / factors` (`(M, R)`, `(R,)`),
    growing a row's scale `(M, 1)` by a power of two where they need it (`reference.append_scaled_columns`).
    In place. Triton on CUDA, the torch reference elsewhere."""
    if use_triton(values):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        return fast.append_scaled_columns(values, scale, projected, factors)
    return reference.append_scaled_columns(values, scale, projected, factors)


def quantize_heads(x):
    """`(B, S, H, D)` -> (e4m3 `(B, S, H, D)`, `(B, H)` float32 descales). Triton on CUDA (an amax pass and a
    quantizing pass), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        return fast.quantize_heads(x)
    return reference.quantize_heads(x)


def head_descales(x):
    """`(B, S, H, D)` -> `(B, H)` float32 per-head descales (amax / 448), as `quantize_heads` computes them. Triton on
    CUDA (one pass), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.fp8_quant import triton as fast  # on first use: see _dispatch

        if x.stride(-1) != 1:
            x = x.contiguous()
        return fast.head_descales(x)
    return reference.head_descales(x)
