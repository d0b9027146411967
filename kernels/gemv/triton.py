"""Few-row linears (decode: one to four rows against a bf16 weight) in Triton, launched with programmatic dependent
launch: each program loads its weight tile before it waits for the previous kernel, so the weight bytes stream in
while that kernel drains (a decode step is a chain of such small GEMVs and their neighbours; cuBLAS kernels,
launched the ordinary way, start only once their predecessor has finished). One program reads `BLOCK_N` whole
weight rows for every row of x. Groups (`grouped_rows_linear`) are independent linears of one shape in one launch.
`normed_rows_linear` computes the RMSNorm of x (after a residual add) in each program before the product, so a
decode step's norm needs no kernel of its own."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs
from h3gen.kernels.argmax.triton import argmax_key, max_keys_into

MAX_ROWS = 4


@triton.jit
def _rows_step(x_rows, w, ks, row_ok, K):
    """`(ROWS, BLOCK_N)` float32 products of x's columns `ks` with the weight tile `w` `(BLOCK_N, BLOCK_K)`."""
    v = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
    return tl.sum(w.to(tl.float32)[None, :, :] * v[:, None, :], axis=2)


@triton.jit
def _normed_rows(x_rows, res_rows, norm_ptr, sum_rows, ks, row_ok, sum_ok, K, eps, ADD: tl.constexpr):
    """The float32 value of `rms_norm(x (+ res), norm)` for all `K` columns of x's rows, rounded as
    `kernels.rmsnorm` rounds (the sum to x's dtype, stored for the rows in `sum_ok`; the normalised value to x's
    dtype; the product with the norm weight to x's dtype)."""
    dtype = x_rows.dtype.element_ty
    mask = row_ok[:, None] & (ks < K)[None, :]
    v = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    norm = tl.load(norm_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    if ADD:  # the residual update first, rounded; the norm reads the rounded sum
        v = (v + tl.load(res_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_rows + ks[None, :], v, mask=sum_ok[:, None] & (ks < K)[None, :])
        v = v.to(tl.float32)
    normed = (v * tl.rsqrt(tl.sum(v * v, axis=1) / K + eps)[:, None]).to(dtype).to(tl.float32)
    return (norm[None, :] * normed).to(dtype).to(tl.float32)


@triton.jit
def _rows_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xg,
    stride_x,
    stride_wg,
    stride_w,
    stride_og,
    stride_o,
    res_ptr,
    norm_ptr,
    sum_ptr,
    eps,
    keys_ptr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    ARGMAX: tl.constexpr,
    PDL: tl.constexpr,
):
    group = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + group * stride_xg + rows[:, None] * stride_x
    w_rows = w_ptr + group * stride_wg + cols[:, None].to(tl.int64) * stride_w
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    wait_for_inputs(PDL)  # the first K step's weights are in flight while the previous kernel drains
    if NORM:  # one K step (BLOCK_K >= K): the norm needs whole rows
        sum_ok = rows < tl.where(tl.program_id(0) == 0, M, 0)  # the first program stores the sum
        v = _normed_rows(
            x_rows, res_ptr + rows[:, None] * K, norm_ptr, sum_ptr + rows[:, None] * K, ks, row_ok, sum_ok, K, eps, ADD
        )
        acc = tl.sum(w.to(tl.float32)[None, :, :] * v[:, None, :], axis=2)
    else:
        acc = _rows_step(x_rows, w, ks, row_ok, K)
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc += _rows_step(x_rows, w, ks, row_ok, K)
    out = out_ptr + group * stride_og + rows[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    if ARGMAX:  # each row's best (value as stored, first index) of this tile, maxed into the row's key slots
        keys = argmax_key(acc.to(out_ptr.dtype.element_ty).to(tl.float32), cols[None, :])
        max_keys_into(keys_ptr, rows, row_ok, tl.max(tl.where(col_ok[None, :], keys, 0), axis=1), tl.program_id(0))


def _tiles(rows: int, k: int, block_n: int | None, block_k: int | None, num_warps: int | None) -> tuple[int, int, int]:
    """Default tiles and warps: up to 2048 of K per step; at one or two rows 4 weight rows per program (8 below K =
    2048) and one warp: many small programs keep the most bytes in flight (H200, the few-row GEMV tile sweep: the best
    or within 10 % of it at every decode shape of the K3 mid config, 1.2-1.5x faster than 4 x 2048 with 4 warps at two
    rows); from three rows about 8 K weights per program and 4 warps."""
    block_k = block_k or min(2048, max(16, next_power_of_2(k)))
    if rows <= 2:
        return block_n or (4 if block_k >= 2048 else 8), block_k, num_warps or 1
    return block_n or max(1, 8192 // (block_k * next_power_of_2(rows))), block_k, num_warps or 4


def grouped_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `reference.grouped_rows_linear`: `x` `[G, M <= 4, K]` and `weight` `[G, N, K]` with unit inner strides
    (any other strides) -> `[G, M, N]` in x.dtype. With `keys` (one group; `kernels.argmax.triton.key_slots`),
    the kernel also leaves each row's argmax there for `argmax_from_keys`."""
    groups, m, k = x.shape
    n = weight.shape[1]
    if (
        m > MAX_ROWS
        or weight.shape[2] != k
        or weight.shape[0] != groups
        or weight.stride(2) != 1
        or x.stride(2) != 1
        or (keys is not None and groups != 1)
    ):
        raise ValueError(
            f"rows_linear takes up to {MAX_ROWS} rows with unit inner strides and matching widths "
            f"(got x {tuple(x.shape)}, weight {tuple(weight.shape)})."
        )
    out = torch.empty(groups, m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = _tiles(m, k, block_n, block_k, num_warps)
    pdl = pdl_launch(x)
    _rows_linear_kernel[(triton.cdiv(n, block_n), groups)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        x,
        x,
        x,
        0.0,
        out if keys is None else keys,
        ROWS=next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=False,
        ADD=False,
        ARGMAX=keys is not None,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )
    return out


def rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `reference.rows_linear` for `x` `[M <= 4, K]` and `weight` `[N, K]`, both with unit inner stride
    (`keys`: see `grouped_rows_linear`)."""
    return grouped_rows_linear(x[None], weight[None], block_n, block_k, num_warps, keys)[0]


# The widest row the norm prologue takes: whole rows live in one K step.
NORMED_MAX_K = 2048


def normed_rows_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.normed_rows_linear`: `x` `[M <= 4, K <= NORMED_MAX_K]` with unit inner stride (contiguous
    with a `residual`, which is too), one dtype with `weight` `[N, K]` (unit inner stride) and `norm_weight` `[K]` ->
    (`x + residual` `[M, K]`, or `x` itself without a residual; the output `[M, N]`). Every program normalises the
    rows itself (they are in L2, a few KB); the first one stores the sum. `keys`: see `grouped_rows_linear`."""
    m, k = x.shape
    n = weight.shape[0]
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous() or not x.is_contiguous()):
        raise ValueError(
            f"normed_rows_linear adds a contiguous residual of x's shape to contiguous x "
            f"(got x {tuple(x.shape)}, residual {tuple(residual.shape)})."
        )
    if (
        m > MAX_ROWS
        or k > NORMED_MAX_K
        or weight.shape[1] != k
        or weight.stride(1) != 1
        or x.stride(1) != 1
        or norm_weight.shape != (k,)
    ):
        raise ValueError(
            f"normed_rows_linear takes up to {MAX_ROWS} contiguous rows of up to {NORMED_MAX_K} "
            f"(got x {tuple(x.shape)}, weight {tuple(weight.shape)}, norm {tuple(norm_weight.shape)})."
        )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    # Two warps at one or two rows: the norm's rows fit in registers beside the weight tile (no spills in sm_90
    # SASS, where one warp spills).
    block_n, block_k, num_warps = _tiles(m, k, block_n, None, num_warps or (2 if m <= 2 else None))
    pdl = pdl_launch(x)
    _rows_linear_kernel[(triton.cdiv(n, block_n), 1)](
        x,
        weight,
        out,
        m,
        n,
        k,
        0,
        x.stride(0),
        0,
        weight.stride(0),
        0,
        out.stride(0),
        x if residual is None else residual,
        norm_weight,
        total,
        eps,
        out if keys is None else keys,
        ROWS=next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=True,
        ADD=residual is not None,
        ARGMAX=keys is not None,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )
    return total, out
