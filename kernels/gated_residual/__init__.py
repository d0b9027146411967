"""AdaLN-gated residual update `x + gate[index] * y`, alone or fused with the next RMSNorm + modulation."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant.reference import copy_rows
from h3gen.kernels.gated_residual import reference


def gated_residual(x, y, gate, index, out=None):
    """`x + gate[index] * y` (x, y `(B, S, H)`, gate `(R, H)`, index `(S,)`); `out=x` writes in place."""
    if use_triton(x):
        from h3gen.kernels.gated_residual import triton as fast  # on first use: see _dispatch

        return fast.gated_residual(x, y, gate, index, out=out)
    result = reference.gated_residual(x, y, gate, index)
    return out.copy_(result) if out is not None else result


def gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, out=None, fp8=False, normed_out=None):
    """`(x_new, rmsnorm_modulate(x_new, weight, shift, scale, index, eps, fp8=fp8))` with
    `x_new = x + gate[index] * y`; `out=x` updates the residual in place, `normed_out` receives the second result
    (as `rmsnorm_modulate`'s `out`)."""
    if use_triton(x):
        from h3gen.kernels.gated_residual import triton as fast  # on first use: see _dispatch

        return fast.gated_residual_norm_modulate(
            x, y, gate, index, weight, shift, scale, eps, out=out, fp8=fp8, normed_out=normed_out
        )
    x_new, modulated = reference.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, fp8=fp8)
    if normed_out is not None:
        modulated = copy_rows(normed_out, modulated)
    return (out.copy_(x_new) if out is not None else x_new), modulated
