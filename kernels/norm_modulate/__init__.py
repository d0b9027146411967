"""RMSNorm + per-row AdaLN shift/scale: `rmsnorm_modulate(x, weight, shift, scale, index, eps)`."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.fp8_quant.reference import copy_rows
from h3gen.kernels.norm_modulate import reference


def rmsnorm_modulate(x, weight, shift, scale, index, eps, fp8=False, out=None):
    """`rms_norm(x) * weight * (1 + scale[index]) + shift[index]`; x `(B, S, H)`, tables `(R, H)`, index `(S,)`;
    `fp8=True` returns `Fp8Rows` (e4m3 per row) for an FP8 GEMM. `out` (optional) receives the result: a `(B, S, H)`
    tensor whose rows may be strided (columns of a wider buffer, as a K-extended LoRA input is), or `Fp8Rows` of
    such values. Triton on CUDA (one pass, float32 math, one rounding), the torch reference elsewhere."""
    if use_triton(x):
        from h3gen.kernels.norm_modulate import triton as fast  # on first use: see _dispatch

        return fast.rmsnorm_modulate(x, weight, shift, scale, index, eps, fp8=fp8, out=out)
    result = reference.rmsnorm_modulate(x, weight, shift, scale, index, eps, fp8=fp8)
    return result if out is None else copy_rows(out, result)
