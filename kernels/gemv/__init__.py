"""Few-row linears for decode steps: `rows_linear(x, weight)` (= `F.linear`, bias-free) and
`grouped_rows_linear` (= a batched `x @ w.T`). On CUDA, up to `MAX_ROWS` rows of x in the weight's dtype take the
Triton kernel (launched to overlap the previous kernel's end, see `triton.py`); anything else, the torch
reference (cuBLAS), which is as fast from there on."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.gemv import reference

MAX_ROWS = 4


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


__all__ = ["MAX_ROWS", "grouped_rows_linear", "rows_linear"]
