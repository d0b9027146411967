"""SwiGLU in one pass: read the fused up-projection once, write half as many values (or, for an FP8 GEMM next,
e4m3 values and one scale per row: a program then holds its whole row).

With a low-rank `update` (an unmerged LoRA of the up-projection, `x + hidden @ up^T`), programs work on tiles of
rows instead, so that the update is one tensor-core dot per tile added as the tile is read: the up-projection's
output is then read once instead of being read and written again by a separate add. The e4m3 variant needs each
row's amax before it can scale: its programs own whole row tiles and compute every tile twice (amax, then values),
which costs a second read of the input but no pass of its own."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.triton import empty_rows, fp8_row, row_fp8_warps


@triton.jit
def _swiglu_row_part(x_ptr, row, width, cols, mask):
    value = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    return value * gate * tl.sigmoid(gate)


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    out = _swiglu_row_part(x_ptr, row, width, cols, mask)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fp8_kernel(x_ptr, q_ptr, scale_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    q, scale = fp8_row(_swiglu_row_part(x_ptr, row, width, cols, mask))
    tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _updated_tile(x_ptr, hidden_ptr, up_ptr, rows, cols, n_rows, width, rank, hidden_stride,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """value * silu(gate) of the `(rows, cols)` tile of `x + hidden @ up^T`, float32, zero outside the matrix."""
    row_in = rows[:, None] < n_rows
    col_in = cols[None, :] < width
    value = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        h = tl.load(hidden_ptr + rows[:, None] * hidden_stride + r[None, :], mask=row_in & (r[None, :] < rank),
                    other=0.0)
        up_mask = (r[:, None] < rank) & col_in
        up_value = tl.load(up_ptr + cols[None, :] * rank + r[:, None], mask=up_mask, other=0.0)
        up_gate = tl.load(up_ptr + (width + cols[None, :]) * rank + r[:, None], mask=up_mask, other=0.0)
        value = tl.dot(h, up_value, value, input_precision=PRECISION)
        gate = tl.dot(h, up_gate, gate, input_precision=PRECISION)
    mask = row_in & col_in
    at = x_ptr + rows[:, None] * 2 * width + cols[None, :]
    value += tl.load(at, mask=mask, other=0.0).to(tl.float32)
    gate += tl.load(at + width, mask=mask, other=0.0).to(tl.float32)
    return value * gate * tl.sigmoid(gate)


@triton.jit
def _swiglu_update_kernel(x_ptr, hidden_ptr, up_ptr, out_ptr, n_rows, width, rank, hidden_stride,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          PRECISION: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _updated_tile(x_ptr, hidden_ptr, up_ptr, rows, cols, n_rows, width, rank, hidden_stride,
                        BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
    tl.store(out_ptr + rows[:, None] * width + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < width))


@triton.jit
def _swiglu_update_fp8_kernel(x_ptr, hidden_ptr, up_ptr, q_ptr, scale_ptr, n_rows, width, rank, hidden_stride,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                              PRECISION: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        tile = _updated_tile(x_ptr, hidden_ptr, up_ptr, rows, cols, n_rows, width, rank, hidden_stride,
                             BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        amax = tl.maximum(amax, tl.max(tl.abs(tile), axis=1))
    scale = tl.maximum(amax, 1e-12) / 448.0  # as `fp8_row`
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        tile = _updated_tile(x_ptr, hidden_ptr, up_ptr, rows, cols, n_rows, width, rank, hidden_stride,
                             BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)
        q = tl.clamp(tile / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + rows[:, None] * width + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=(rows[:, None] < n_rows) & (cols[None, :] < width))
    tl.store(scale_ptr + rows, scale, mask=rows < n_rows)


def _with_update(x, update, fp8, block_m, block_n, num_warps):
    hidden, up = update
    width = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    rank = up.shape[1]
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    up = up.to(hidden.dtype).contiguous()
    # tl.dot takes K >= 16; float32 inputs get full float32 products (the default would be TF32)
    args = dict(BLOCK_R=min(64, max(16, next_power_of_2(rank))), PRECISION="ieee" if hidden.dtype == torch.float32
                else "tf32", num_warps=num_warps)
    if fp8:
        out = empty_rows((*x.shape[:-1], width), rows, x.device)
        _swiglu_update_fp8_kernel[(triton.cdiv(rows, block_m),)](
            x, hidden, up, out.values, out.scale, rows, width, rank, hidden.stride(0), BLOCK_M=block_m,
            BLOCK_N=block_n, **args)
        return out
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    _swiglu_update_kernel[(triton.cdiv(rows, block_m), triton.cdiv(width, block_n))](
        x, hidden, up, out, rows, width, rank, hidden.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, **args)
    return out


def swiglu(x, fp8=False, update=None, block=1024, num_warps=4, update_blocks=(64, 128), update_warps=8):
    """Same contract as `reference.swiglu`; `block` and `num_warps` tune the row launch, `update_blocks` (rows,
    columns of a tile) and `update_warps` the tiled one that adds `update`."""
    x = x.contiguous()
    if update is not None:
        return _with_update(x, update, fp8, *update_blocks, update_warps)
    width = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    if fp8:
        out = empty_rows((*x.shape[:-1], width), rows, x.device)
        row_block = next_power_of_2(width)
        _swiglu_fp8_kernel[(rows,)](x, out.values, out.scale, width, BLOCK=row_block,
                                    num_warps=row_fp8_warps(row_block))
        return out
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    _swiglu_kernel[(rows, triton.cdiv(width, block))](x, out, width, BLOCK=block, num_warps=num_warps)
    return out
