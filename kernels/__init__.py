"""Kernels (`h3gen.kernels`). Each fast op sits next to a plain-torch reference with the same signature; the public
function of an op picks the fast path on CUDA and the reference elsewhere."""

from h3gen.kernels.attention import attention, available_attention_backends

__all__ = ["attention", "available_attention_backends"]
