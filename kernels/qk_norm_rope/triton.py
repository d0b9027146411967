"""Per-head RMSNorm + RoPE of q or k in one pass: one program normalises and rotates every head of one row.

With a low-rank `update` (an unmerged LoRA of the projection, `x + hidden @ up^T`), a program takes a tile of rows
of one head instead, so that the update is a tensor-core dot per tile (and one more for the RoPE partners' columns)
added as the tile is read, instead of a separate pass reading and writing the projection's output."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.reference import FP8
from h3gen.kernels.qk_norm_rope.reference import fp8_scale


@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, fp8_scale_ptr, seq_len, heads, head_dim, rotary,
                         x_row_stride, out_s_stride, out_h_stride, out_b_stride, eps, FP8_OUT: tl.constexpr,
                         HEADS: tl.constexpr, DIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over batch * seq_len
    b, s = row // seq_len, row % seq_len
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # this program's group of heads
    d = tl.arange(0, DIM)[None, :]
    mask = (h < heads) & (d < head_dim)
    base = x_ptr + row * x_row_stride + h * head_dim
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]
    half = rotary // 2
    in_rot = d < rotary
    partner = tl.where(d < half, d + half, tl.where(in_rot, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    w = tl.load(w_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d < head_dim, other=0.0).to(tl.float32)
    x_partner = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    xn = x * inv_rms * w
    pn = x_partner * inv_rms * w_partner
    cos = tl.load(cos_ptr + s * rotary + d, mask=in_rot, other=1.0)
    sin = tl.load(sin_ptr + s * rotary + d, mask=in_rot, other=0.0)
    out = tl.where(in_rot, xn * cos + sign * pn * sin, xn)
    if FP8_OUT:
        out = tl.clamp(out * (1.0 / tl.load(fp8_scale_ptr)), -448.0, 448.0)  # one reciprocal: division halves the rate
    target = out_ptr + b * out_b_stride + s * out_s_stride + h * out_h_stride + d
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_update(hidden_ptr, up_ptr, rows, cols, n_rows, rank, hidden_stride, BLOCK_M: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """`hidden @ up^T` on the `(rows, cols)` tile (cols: indices into up's rows), float32."""
    acc = tl.zeros((BLOCK_M, DIM), dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        h = tl.load(hidden_ptr + rows[:, None] * hidden_stride + r[None, :],
                    mask=(rows[:, None] < n_rows) & (r[None, :] < rank), other=0.0)
        up = tl.load(up_ptr + cols * rank + r[:, None], mask=r[:, None] < rank, other=0.0)
        acc = tl.dot(h, up, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _qk_norm_rope_update_kernel(x_ptr, hidden_ptr, up_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, fp8_scale_ptr, n_rows,
                                seq_len, head_dim, rotary, rank, x_row_stride, hidden_stride, out_s_stride,
                                out_h_stride, out_b_stride, eps, FP8_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                                DIM: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # over batch * seq_len
    h = tl.program_id(1)
    b, s = rows[:, None] // seq_len, rows[:, None] % seq_len
    d = tl.arange(0, DIM)[None, :]
    mask = (rows[:, None] < n_rows) & (d < head_dim)
    half = rotary // 2
    in_rot = d < rotary
    partner = tl.where(d < half, d + half, tl.where(in_rot, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    base = x_ptr + rows[:, None] * x_row_stride + h * head_dim
    # masked columns (d >= head_dim) read this head's last row of `up`: finite, and masked out below
    last = h * head_dim + head_dim - 1
    own = tl.minimum(h * head_dim + d, last)
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x += _head_update(hidden_ptr, up_ptr, rows, own, n_rows, rank, hidden_stride, BLOCK_M, DIM, BLOCK_R, PRECISION)
    x = tl.where(mask, x, 0.0)
    x_partner = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    x_partner += _head_update(hidden_ptr, up_ptr, rows, tl.minimum(h * head_dim + partner, last), n_rows, rank,
                              hidden_stride, BLOCK_M, DIM, BLOCK_R, PRECISION)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d < head_dim, other=0.0).to(tl.float32)
    xn = x * inv_rms * w
    pn = x_partner * inv_rms * w_partner
    cos = tl.load(cos_ptr + s * rotary + d, mask=in_rot & (rows[:, None] < n_rows), other=1.0)
    sin = tl.load(sin_ptr + s * rotary + d, mask=in_rot & (rows[:, None] < n_rows), other=0.0)
    out = tl.where(in_rot, xn * cos + sign * pn * sin, xn)
    if FP8_OUT:
        out = tl.clamp(out * (1.0 / tl.load(fp8_scale_ptr)), -448.0, 448.0)
    target = out_ptr + b * out_b_stride + s * out_s_stride + h * out_h_stride + d
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=mask)


def _one(x, weight, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8=False, update=None,
         update_rows=64):
    batch, seq_len, heads, head_dim = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != head_dim:
        x = x.contiguous()
    dtype = FP8 if fp8 else x.dtype
    scale = fp8_scale(weight) if fp8 else weight
    if heads_first:
        out = torch.empty((batch, heads, seq_len, head_dim), dtype=dtype, device=x.device)
        s_stride, h_stride = head_dim, seq_len * head_dim
    else:
        out = torch.empty((batch, seq_len, heads, head_dim), dtype=dtype, device=x.device)
        s_stride, h_stride = heads * head_dim, head_dim
    dim_block = next_power_of_2(head_dim)
    if update is not None:
        hidden, up = update
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        up = up.to(hidden.dtype).contiguous()
        rows, rank = batch * seq_len, up.shape[1]
        # tl.dot takes K >= 16; float32 inputs get full float32 products (the default would be TF32)
        _qk_norm_rope_update_kernel[(triton.cdiv(rows, update_rows), heads)](
            x, hidden, up, weight, cos, sin, out, scale, rows, seq_len, head_dim, cos.shape[-1], rank, x.stride(1),
            hidden.stride(0), s_stride, h_stride, heads * seq_len * head_dim, eps, FP8_OUT=fp8,
            BLOCK_M=update_rows, DIM=dim_block, BLOCK_R=min(64, max(16, next_power_of_2(rank))),
            PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", num_warps=num_warps)
        return (out, scale.expand(batch, heads).contiguous()) if fp8 else out
    heads_block = min(next_power_of_2(heads), heads_per_program)
    _qk_norm_rope_kernel[(batch * seq_len, triton.cdiv(heads, heads_block))](
        x, weight, cos, sin, out, scale, seq_len, heads, head_dim, cos.shape[-1], x.stride(1), s_stride, h_stride,
        heads * seq_len * head_dim, eps, FP8_OUT=fp8, HEADS=heads_block, DIM=dim_block,
        num_warps=num_warps or (8 if heads_block * dim_block >= 4096 else 4),
    )
    return (out, scale.expand(batch, heads).contiguous()) if fp8 else out


def qk_norm_rope(q, k, weight_q, weight_k, cos, sin, eps, heads_first=False, fp8=False, updates=(None, None),
                 heads_per_program=16, num_warps=4, update_rows=64):
    """Same contract as `reference.qk_norm_rope`; `heads_per_program` and `num_warps` tune the launch,
    `update_rows` the rows of a tile where an update is added."""
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return (_one(q, weight_q, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8, updates[0], update_rows),
            _one(k, weight_k, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8, updates[1], update_rows))
