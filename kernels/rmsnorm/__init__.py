"""RMSNorm with K3's rounding (`rms_norm(x, weight, eps)`), alone or after a residual add (`add_rms_norm`): Triton
on CUDA, the torch reference elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.rmsnorm import reference


def rms_norm(x, weight, eps, out_dtype=None):
    """`x` `[..., D]`, `weight` `[D]` -> `[..., D]`, in `out_dtype` when given (see `reference.rms_norm`)."""
    if use_triton(x):
        from h3gen.kernels.rmsnorm import triton as fast  # on first use: see _dispatch

        return fast.rms_norm(x, weight, eps, out_dtype)
    return reference.rms_norm(x, weight, eps, out_dtype)


def add_rms_norm(x, y, weight, eps):
    """`(x + y, rms_norm(x + y, weight, eps))` for `x`, `y` `[..., D]` of one dtype (one pass on CUDA)."""
    if use_triton(x) and x.dtype == y.dtype and x.shape == y.shape:
        from h3gen.kernels.rmsnorm import triton as fast  # on first use: see _dispatch

        return fast.add_rms_norm(x, y, weight, eps)
    return reference.add_rms_norm(x, y, weight, eps)


__all__ = ["add_rms_norm", "rms_norm"]
