"""RMSNorm with K3's rounding (`rms_norm(x, weight, eps)`): Triton on CUDA, the torch reference elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.rmsnorm import reference


def rms_norm(x, weight, eps):
    """`x` `[..., D]`, `weight` `[D]` -> `[..., D]` (see `reference.rms_norm`)."""
    if use_triton(x):
        from h3gen.kernels.rmsnorm import triton as fast

        return fast.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


__all__ = ["rms_norm"]
