"""Few-row linears for decode steps: `rows_linear(x, weight)` (= `F.linear`, bias-free),
`grouped_rows_linear` (= a batched `x @ w.T`) and `normed_rows_linear` (a residual add and RMSNorm, then the
linear); `rows_linear_argmax` and `normed_rows_linear_argmax` also return the output's row argmax (a decode
step's head: its greedy tokens). On CUDA, up to `MAX_ROWS` rows of x in the weight's dtype take the
Triton kernel (launched to overlap the previous kernel's end, see `triton.py`; with the argmax, it leaves each
tile's best as keys that one tiny kernel reads, instead of a pass over the logits); anything else, the torch
reference (cuBLAS), which is as fast from there on."""

import torch

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.argmax import argmax_rows
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
        from h3gen.kernels.gemv import triton as fast  # on first use: see _dispatch

        flat = x.reshape(rows, x.shape[-1])
        return fast.rows_linear(flat, weight).view(*x.shape[:-1], weight.shape[0])
    return reference.rows_linear(x, weight)


def _argmax_of(out, into=None):
    """`out` `[..., N]` -> its row argmax `[...]` int64 (copied into `into`, `[rows]`, when given)."""
    index = argmax_rows(out.reshape(-1, out.shape[-1]))
    if into is not None:
        index = into.copy_(index)
    return index.view(out.shape[:-1])


def rows_linear_argmax(x, weight, into=None):
    """(`rows_linear(x, weight)` `[..., N]`, its argmax over N `[...]` int64: torch's argmax of the output as
    stored, the first index of the maximum, a NaN the largest). `into`: a contiguous int64 tensor of x's rows
    count that receives the argmax (and is returned, viewed as `[...]`)."""
    rows = x.numel() // max(1, x.shape[-1])
    if 0 < rows <= MAX_ROWS and _fast(x, weight):
        from h3gen.kernels.argmax import triton as fast_argmax  # on first use: see _dispatch
        from h3gen.kernels.gemv import triton as fast  # on first use: see _dispatch

        keys = fast_argmax.key_slots(x.device, rows)
        out = fast.rows_linear(x.reshape(rows, x.shape[-1]), weight, keys=keys)
        index = fast_argmax.argmax_from_keys(keys, rows, into)
        return out.view(*x.shape[:-1], weight.shape[0]), index.view(x.shape[:-1])
    out = reference.rows_linear(x, weight)
    return out, _argmax_of(out, into)


def grouped_rows_linear(x, weight):
    """`x` `[G, M, K]`, `weight` `[G, N, K]` -> `[G, M, N]` (see `reference.grouped_rows_linear`)."""
    if 0 < x.shape[1] <= MAX_ROWS and _fast(x, weight):
        from h3gen.kernels.gemv import triton as fast  # on first use: see _dispatch

        return fast.grouped_rows_linear(x, weight)
    return reference.grouped_rows_linear(x, weight)


def _normed_fast(x, norm_weight, weight, residual) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_ROWS
        and x.shape[-1] <= NORMED_MAX_K
        and _fast(x, weight)
        and torch.promote_types(norm_weight.dtype, x.dtype) == x.dtype
        and (residual is None or (x.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape))
    )


def _normed_kernel(x, norm_weight, eps, weight, residual, keys=None):
    """The Triton path of `normed_rows_linear` (`keys`: see `triton.grouped_rows_linear`)."""
    from h3gen.kernels.gemv import triton as fast  # on first use: see _dispatch

    k = x.shape[-1]
    rows = x.numel() // k
    res = None if residual is None else residual.reshape(rows, k).contiguous()
    total, out = fast.normed_rows_linear(x.reshape(rows, k), norm_weight, eps, weight, res, keys=keys)
    return total.view(x.shape) if residual is not None else x, out.view(*x.shape[:-1], weight.shape[0])


def normed_rows_linear(x, norm_weight, eps, weight, residual=None):
    """`(s, rows_linear(rms_norm(s, norm_weight, eps), weight))` with `s = x + residual` (or `x`), for `x` `[..., K]`
    (see `reference.normed_rows_linear`). Few rows on CUDA take one kernel (the norm in each program's prologue);
    otherwise the norm's kernel, then `rows_linear`."""
    if _normed_fast(x, norm_weight, weight, residual):
        return _normed_kernel(x, norm_weight, eps, weight, residual)
    if residual is None:
        return x, rows_linear(rms_norm(x, norm_weight, eps), weight)
    total, normed = add_rms_norm(x, residual, norm_weight, eps)
    return total, rows_linear(normed, weight)


def normed_rows_linear_argmax(x, norm_weight, eps, weight, residual=None, into=None):
    """`normed_rows_linear` plus the output's argmax over N (as `rows_linear_argmax`, `into` too): (s `[..., K]`,
    out `[..., N]`, argmax `[...]` int64)."""
    if _normed_fast(x, norm_weight, weight, residual):
        from h3gen.kernels.argmax import triton as fast_argmax  # on first use: see _dispatch

        rows = x.numel() // x.shape[-1]
        keys = fast_argmax.key_slots(x.device, rows)
        total, out = _normed_kernel(x, norm_weight, eps, weight, residual, keys)
        return total, out, fast_argmax.argmax_from_keys(keys, rows, into).view(x.shape[:-1])
    total, out = normed_rows_linear(x, norm_weight, eps, weight, residual)
    return total, out, _argmax_of(out, into)


__all__ = [
    "MAX_ROWS",
    "NORMED_MAX_K",
    "grouped_rows_linear",
    "normed_rows_linear",
    "normed_rows_linear_argmax",
    "rows_linear",
    "rows_linear_argmax",
]
