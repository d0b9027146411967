"""SwiGLU activation: `swiglu(x)` = value * silu(gate) for x = `[value; gate]` on the last axis."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.swiglu import reference


def swiglu(x, fp8=False, update=None):
    """`(..., 2F)` -> `(..., F)`, or `Fp8Rows` (e4m3 per row) with `fp8=True`; `update` = `(hidden (M, r), up
    (2F, r))` adds `hidden @ up^T` to x's M rows first (an unmerged LoRA, read with x instead of added by a pass of
    its own). Triton on CUDA (one pass, float32 math; two reads of x for e4m3 with an update), the torch
    reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.swiglu import triton as fast  # on first use: see _dispatch

        return fast.swiglu(x, fp8=fp8, update=update)
    return reference.swiglu(x, fp8=fp8, update=update)
