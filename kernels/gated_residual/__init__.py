"""AdaLN-gated residual update `x + gate[index] * y`, alone or fused with the next RMSNorm + modulation."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.gated_residual import reference


def gated_residual(x, y, gate, index, out=None):
    """`x + gate[index] * y` (x, y `(B, S, H)`, gate `(R, H)`, index `(S,)`); `out=x` writes in place."""
    if use_triton(x):
        from h3gen.kernels.gated_residual import triton as fast  # on first use: see _dispatch

        return fast.gated_residual(x, y, gate, index, out=out)
    result = reference.gated_residual(x, y, gate, index)
    return out.copy_(result) if out is not None else result


def gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, out=None, fp8=False):
    """`(x_new, rmsnorm_modulate(x_new, weight, shift, scale, index, eps, fp8=fp8))` with
    `x_new = x + gate[index] * y`."""
    if use_triton(x):
        from h3gen.kernels.gated_residual import triton as fast  # on first use: see _dispatch

        return fast.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, out=out, fp8=fp8)
    x_new, modulated = reference.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, fp8=fp8)
    return (out.copy_(x_new) if out is not None else x_new), modulated
