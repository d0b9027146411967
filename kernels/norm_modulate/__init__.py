"""RMSNorm + per-row AdaLN shift/scale: `rmsnorm_modulate(x, weight, shift, scale, index, eps)`."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.norm_modulate import reference


def rmsnorm_modulate(x, weight, shift, scale, index, eps):
    """`rms_norm(x) * weight * (1 + scale[index]) + shift[index]`; x `(B, S, H)`, tables `(R, H)`, index `(S,)`.
    Triton on CUDA (one pass, float32 math, one rounding), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.norm_modulate import triton as fast

        return fast.rmsnorm_modulate(x, weight, shift, scale, index, eps)
    return reference.rmsnorm_modulate(x, weight, shift, scale, index, eps)
