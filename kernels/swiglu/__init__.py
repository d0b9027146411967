"""SwiGLU activation: `swiglu(x)` = value * silu(gate) for x = `[value; gate]` on the last axis."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant.reference import copy_rows
from h3gen.kernels.swiglu import reference


def swiglu(x, fp8=False, out=None):
    """`(..., 2F)` -> `(..., F)`, or `Fp8Rows` (e4m3 per row) with `fp8=True`; `out` (optional) receives it, its rows
    possibly strided (see `rmsnorm_modulate`). Triton on CUDA (one pass, float32 math), the torch reference
    elsewhere."""
    if use_triton(x):
        from h3gen.kernels.swiglu import triton as fast  # on first use: see _dispatch

        return fast.swiglu(x, fp8=fp8, out=out)
    result = reference.swiglu(x, fp8=fp8)
    return result if out is None else copy_rows(out, result)
