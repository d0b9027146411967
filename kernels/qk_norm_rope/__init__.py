"""Per-head q/k RMSNorm + RoPE (the first `cos.shape[-1]` channels rotated): `qk_norm_rope(q, k, ...)`."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.qk_norm_rope import reference


def qk_norm_rope(q, k, weight_q, weight_k, cos, sin, eps, heads_first=False, fp8=False):
    """q, k `(B, S, heads, D)` -> normalised and rotated `(q, k)`, `(B, heads, S, D)` when `heads_first`; with
    `fp8`, `((q, q_descale), (k, k_descale))` in e4m3 for FP8 attention (see `reference.fp8_scale`).
    Triton on CUDA (one pass per tensor, float32 math), the torch reference elsewhere."""
    if use_triton(q):
        from h3gen.kernels.qk_norm_rope import triton as fast  # on first use: see _dispatch

        return fast.qk_norm_rope(q, k, weight_q, weight_k, cos, sin, eps, heads_first, fp8=fp8)
    return reference.qk_norm_rope(q, k, weight_q, weight_k, cos, sin, eps, heads_first, fp8=fp8)
