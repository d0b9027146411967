"""Flash attention forward: `flash_attention(q, k, v)` over `(B, H, S, D)`; Triton on CUDA, torch elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.flash_attention import reference


def flash_attention(query, key, value, **config):
    """Full softmax attention, scale 1/sqrt(D); `(B, H, S, D)` in, same out. `config` tunes the Triton kernel."""
    if use_triton(query):
        from h3gen.kernels.flash_attention import triton as fast

        return fast.flash_attention(query, key, value, **config)
    return reference.flash_attention(query, key, value)
