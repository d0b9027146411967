"""Few-row linears for decode steps: `rows_linear(x, weight)` (= `F.linear`, bias-free),
`grouped_rows_linear` (= a batched `x @ w.T`) and `normed_rows_linear` (a residual add and RMSNorm, then the
linear). On CUDA, up to `MAX_ROWS` rows of x in the weight's dtype take the
Triton kernel (launched to overlap the previous kernel's end, see `triton.py`); anything else, the torch
reference (cuBLAS), which is as fast from there on."""

import torch

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.gemv import reference
from h3gen.kernels.rmsnorm import add_rms_norm, rms_norm

MAX_ROWS = 4
NORMED_MAX_K = 2048  # the widest rows `normed_rows_linear` normalises in its kernel (as `triton.NORMED_MAX_K`)


def _fast(x, weight) -> bool:
    return use_triton(x) and x.dtype == weight.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1


def rows_linear(x, weight):
    """`x` `[..., K]` @ `weight` `[N, K]`.T -> `[..., N]` (see `reference.rows_linear`)."""
    rows = x.numel() // max(1, x.shape[-1])
    if 0 < rows <= MAX_ROWS and _fast(x, weight):
        from h3gen.kernels.gemv import triton as fast

        flat = x.reshape(rows, x.shape[-1])
        return fast.rows_linear(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return reference.rows_linear(x, weight)


def grouped_rows_linear(x, weight):
    """`x` `[G, M, K]`, `weight` `[G, N, K]` -> `[G, M, N]` (see `reference.grouped_rows_linear`)."""
    if 0 < x.shape[1] <= MAX_ROWS and _fast(x, weight):
        from h3gen.kernels.gemv import triton as fast

        return fast.grouped_rows_linear(x, weight)
    return reference.grouped_rows_linear(x, weight)


def normed_rows_linear(x, norm_weight, eps, weight, residual=None):
    """`(s, rows_linear(rms_norm(s, norm_weight, eps), weight))` with `s = x + residual` (or `x`), for `x` `[..., K]`
    (see `reference.normed_rows_linear`). Few rows on CUDA take one kernel (the norm in each program's prologue);
    otherwise the norm's kernel, then `rows_linear`."""
    rows = x.numel() // max(1, x.shape[-1])
    k = x.shape[-1]
    if (0 < rows <= MAX_ROWS and k <= NORMED_MAX_K and _fast(x, weight)
            and torch.promote_types(norm_weight.dtype, x.dtype) == x.dtype
            and (residual is None or (x.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape))):
        from h3gen.kernels.gemv import triton as fast

        res = None if residual is None else residual.reshape(rows, k).contiguous()
        total, out = fast.normed_rows_linear(x.reshape(rows, k), norm_weight, eps, weight, res)
        return total.view(x.shape) if residual is not None else x, out.view(*x.shape[:-1], weight.shape[0])
    if residual is None:
        return x, rows_linear(rms_norm(x, norm_weight, eps), weight)
    total, normed = add_rms_norm(x, residual, norm_weight, eps)
    return total, rows_linear(normed, weight)


__all__ = ["MAX_ROWS", "NORMED_MAX_K", "grouped_rows_linear", "normed_rows_linear", "rows_linear"]
