"""FP8 (e4m3) quantization kernels: per row in one pass (each program reads its row once, finds the amax, writes
e4m3 + scale) and per (batch, head) in two (partial amaxes, then the quantizing pass). `fp8_row` is the row
quantizer the fused row kernels (norm + modulate, gated residual, SwiGLU) share."""

import math
import os

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.reference import FP8, FP8_MAX, Fp8Rows


@triton.jit
def fp8_row(y):
    """A float32 row `y` (masked lanes zero) -> (`y / scale` saturated to +-448, still float32; the float32
    scale amax / 448). The caller casts the first to e4m3 when storing."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    return tl.clamp(y / scale, -448.0, 448.0), scale


def interpreted() -> bool:
    """Whether kernels run under the Triton interpreter (`TRITON_INTERPRET=1`): `to_e4m3`'s `BY_HAND` for them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def to_e4m3(x, BY_HAND: tl.constexpr):
    """float32 `x` within +-448 -> e4m3, rounded to nearest (even). `BY_HAND` rounds onto the e4m3 grid in float32
    first (3 mantissa bits; steps of 2^-9 below 2^-6) so that the cast itself is exact: the Triton interpreter's own
    e4m3 cast drops the carry into the next power of two (7.9 -> 4 where 8 is right), a GPU's does not."""
    if BY_HAND:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: float32 rounds to integers
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, width, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = fp8_row(x)
    tl.store(q_ptr + row * out_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _append_scaled_columns_kernel(
    values_ptr,
    scale_ptr,
    projected_ptr,
    factors_ptr,
    width,
    extra,
    row_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < extra
    factors = tl.load(factors_ptr + cols, mask=mask, other=1.0)
    part = tl.load(projected_ptr + row * extra + cols, mask=mask, other=0.0).to(tl.float32) / factors
    peak = tl.max(tl.abs(part), axis=0)
    t = tl.exp2(tl.ceil(tl.log2(tl.maximum(peak, 448.0) / 448.0)))  # 1, or the power of two that fits
    tl.store(
        values_ptr + row * row_stride + width + cols,
        tl.clamp(part / t, -448.0, 448.0).to(values_ptr.dtype.element_ty),
        mask=mask,
    )
    if t > 1.0:  # rare: this row's scale grows by t, its first `width` values shrink by t
        tl.store(scale_ptr + row, tl.load(scale_ptr + row) * t)
        for start in range(0, width, BLOCK_K):
            offs = start + tl.arange(0, BLOCK_K)
            keep = offs < width
            x = tl.load(values_ptr + row * row_stride + offs, mask=keep, other=0.0).to(tl.float32)
            tl.store(values_ptr + row * row_stride + offs, (x / t).to(values_ptr.dtype.element_ty), mask=keep)


def append_scaled_columns(values, scale, projected, factors):
    """Same contract as `reference.append_scaled_columns`; one program per row, which rewrites the row's first
    columns only when its new ones need the larger scale."""
    rows, extra = projected.shape
    if values.stride(-1) != 1 or projected.stride(-1) != 1 or projected.stride(0) != extra:
        raise ValueError("append_scaled_columns takes rows with contiguous columns and a contiguous projection")
    _append_scaled_columns_kernel[(rows,)](
        values,
        scale,
        projected,
        factors.contiguous(),
        values.shape[1] - extra,
        extra,
        values.stride(0),
        BLOCK_R=next_power_of_2(extra),
        BLOCK_K=1024,
        num_warps=4,
    )


def row_fp8_warps(block: int) -> int:
    """Warps for a one-row-per-program FP8 kernel over `block` columns (registers for the whole row)."""
    return 16 if block >= 8192 else 8


def empty_rows(shape, rows: int, device) -> Fp8Rows:
    """Uninitialised `Fp8Rows` for `rows` rows of the given shape."""
    return Fp8Rows(
        torch.empty(shape, dtype=FP8, device=device), torch.empty((rows, 1), dtype=torch.float32, device=device)
    )


def output_rows(shape, dtype, device, fp8: bool, out=None):
    """A row kernel's output of `shape` `(..., H)` and the stride between its rows: `out` if given (a tensor, or
    `Fp8Rows` when `fp8`, whose rows may be strided: a column slice of a wider buffer), else a new tensor in `dtype`
    or new `Fp8Rows`. Its columns must be contiguous and its rows evenly spaced."""
    if out is None:
        out = (
            empty_rows(shape, math.prod(shape[:-1]), device) if fp8 else torch.empty(shape, dtype=dtype, device=device)
        )
    values = out.values if fp8 else out
    if tuple(values.shape) != tuple(shape):
        raise ValueError(f"a row kernel's output has shape {tuple(values.shape)}, not {tuple(shape)}")
    rows = values.reshape(-1, values.shape[-1])
    if values.stride(-1) != 1 or rows.untyped_storage().data_ptr() != values.untyped_storage().data_ptr():
        raise ValueError("a row kernel's output needs contiguous columns and evenly spaced rows")
    return out, rows.stride(0)


def quantize_rows(x, out=None):
    """Same contract as `reference.quantize_rows` (and its dispatcher's `out`)."""
    x = x.contiguous()
    width = x.shape[-1]
    rows = x.numel() // width
    out, stride = output_rows(x.shape, None, x.device, True, out)
    block = next_power_of_2(width)
    _quantize_rows_kernel[(rows,)](x, out.values, out.scale, width, stride, BLOCK=block, num_warps=row_fp8_warps(block))
    return out


@triton.jit
def _head_tile(seq_len, head_dim, stride_b, stride_s, stride_h, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's `(BLOCK_S, BLOCK_D)` tile of one (batch, head) of a tensor with the given strides: offsets
    and mask."""
    b, block, h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = (block * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    return b * stride_b + s * stride_s + h * stride_h + d, (s < seq_len) & (d < head_dim)


@triton.jit
def _head_amax_kernel(
    x_ptr,
    partial_ptr,
    seq_len,
    heads,
    head_dim,
    stride_b,
    stride_s,
    stride_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offsets, mask = _head_tile(seq_len, head_dim, stride_b, stride_s, stride_h, BLOCK_S, BLOCK_D)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b, block, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tl.store(partial_ptr + (b * tl.num_programs(1) + block) * heads + h, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _head_quantize_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    seq_len,
    heads,
    head_dim,
    stride_b,
    stride_s,
    stride_h,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offsets, mask = _head_tile(seq_len, head_dim, stride_b, stride_s, stride_h, BLOCK_S, BLOCK_D)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + tl.program_id(0) * heads + tl.program_id(2))
    out_offsets, _ = _head_tile(
        seq_len, head_dim, seq_len * heads * head_dim, heads * head_dim, head_dim, BLOCK_S, BLOCK_D
    )
    tl.store(q_ptr + out_offsets, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)


def _launch_per_head(kernel, x, buffers, block_s: int) -> None:
    """`kernel` over `x` `(B, S, H, D)` (unit channel stride) with its `buffers` after `x`: one program per (batch,
    block of `block_s` rows, head)."""
    batch, seq_len, heads, head_dim = x.shape
    grid = (batch, triton.cdiv(seq_len, block_s), heads)
    kernel[grid](
        x,
        *buffers,
        seq_len,
        heads,
        head_dim,
        *x.stride()[:3],
        BLOCK_S=block_s,
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )


def head_descales(x, block_s: int = 64):
    """Same contract as `reference.head_descales`, in one pass of partial amaxes; `x` any `(B, S, H, D)` view with
    unit channel stride."""
    batch, seq_len, heads, _ = x.shape
    partial = torch.empty((batch, triton.cdiv(seq_len, block_s), heads), dtype=torch.float32, device=x.device)
    _launch_per_head(_head_amax_kernel, x, (partial,), block_s)
    return (partial.amax(dim=1).clamp_min(1e-12) / FP8_MAX).contiguous()


def quantize_heads(x, block_s: int = 64):
    """Same contract as `reference.quantize_heads`; `x` may be any `(B, S, H, D)` view with unit channel stride,
    the values come back contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale = head_descales(x, block_s)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    _launch_per_head(_head_quantize_kernel, x, (scale, q), block_s)
    return q, scale
