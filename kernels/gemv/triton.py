"""Few-row linears (decode: one to four rows against a bf16 weight) in Triton, launched with programmatic dependent
launch: each program loads its weight tile before it waits for the previous kernel, so the weight bytes stream in
while that kernel drains (a decode step is a chain of such small GEMVs and their neighbours; cuBLAS kernels,
launched the ordinary way, start only once their predecessor has finished). One program reads `BLOCK_N` whole
weight rows for every row of x. Groups (`grouped_rows_linear`) are independent linears of one shape in one launch."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs

MAX_ROWS = 4


@triton.jit
def _rows_step(x_rows, w, ks, row_ok, K):
    """`(ROWS, BLOCK_N)` float32 products of x's columns `ks` with the weight tile `w` `(BLOCK_N, BLOCK_K)`."""
    v = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
    return tl.sum(w.to(tl.float32)[None, :, :] * v[:, None, :], axis=2)


@triton.jit
def _rows_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xg, stride_x, stride_wg, stride_w, stride_og, stride_o,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
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
    acc = _rows_step(x_rows, w, ks, row_ok, K)
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc += _rows_step(x_rows, w, ks, row_ok, K)
    out = out_ptr + group * stride_og + rows[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tiles(rows: int, k: int, block_n: int | None, block_k: int | None,
           num_warps: int | None) -> tuple[int, int, int]:
    """Default tiles and warps: up to 2048 of K per step; at one or two rows 4 weight rows per program (8 below K
    = 2048) and one warp: many small programs keep the most bytes in flight (H200, `.gpu/rows_sweep.py` in
    RESULTS.md: the best or within 10 % of it at every decode shape of the K3 mid config, 1.2-1.5x faster than
    4 x 2048 with 4 warps at two rows); from three rows about 8 K weights per program and 4 warps."""
    block_k = block_k or min(2048, max(16, next_power_of_2(k)))
    if rows <= 2:
        return block_n or (4 if block_k >= 2048 else 8), block_k, num_warps or 1
    return block_n or max(1, 8192 // (block_k * next_power_of_2(rows))), block_k, num_warps or 4


def grouped_rows_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                        block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """See `reference.grouped_rows_linear`: `x` `[G, M <= 4, K]` and `weight` `[G, N, K]` with unit inner strides
    (any other strides) -> `[G, M, N]` in x.dtype."""
    groups, m, k = x.shape
    n = weight.shape[1]
    if m > MAX_ROWS or weight.shape[2] != k or weight.shape[0] != groups or weight.stride(2) != 1 or \
            x.stride(2) != 1:
        raise ValueError(f"rows_linear takes up to {MAX_ROWS} rows with unit inner strides and matching widths "
                         f"(got x {tuple(x.shape)}, weight {tuple(weight.shape)}).")
    out = torch.empty(groups, m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = _tiles(m, k, block_n, block_k, num_warps)
    pdl = pdl_launch(x)
    _rows_linear_kernel[(triton.cdiv(n, block_n), groups)](
        x, weight, out, m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        out.stride(1), ROWS=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_flag(pdl),
        num_warps=num_warps, **pdl)
    return out


def rows_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """See `reference.rows_linear` for `x` `[M <= 4, K]` and `weight` `[N, K]`, both with unit inner stride."""
    return grouped_rows_linear(x[None], weight[None], block_n, block_k, num_warps)[0]
