"""Per-head RMSNorm + RoPE of q or k in one pass: one program normalises and rotates every head of one row."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.reference import FP8
from h3gen.kernels.qk_norm_rope.reference import fp8_scale


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    fp8_scale_ptr,
    seq_len,
    heads,
    head_dim,
    rotary,
    x_row_stride,
    out_s_stride,
    out_h_stride,
    out_b_stride,
    eps,
    FP8_OUT: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
):
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


def _one(x, weight, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8=False):
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
    heads_block = min(next_power_of_2(heads), heads_per_program)
    dim_block = next_power_of_2(head_dim)
    _qk_norm_rope_kernel[(batch * seq_len, triton.cdiv(heads, heads_block))](
        x,
        weight,
        cos,
        sin,
        out,
        scale,
        seq_len,
        heads,
        head_dim,
        cos.shape[-1],
        x.stride(1),
        s_stride,
        h_stride,
        heads * seq_len * head_dim,
        eps,
        FP8_OUT=fp8,
        HEADS=heads_block,
        DIM=dim_block,
        num_warps=num_warps or (8 if heads_block * dim_block >= 4096 else 4),
    )
    return (out, scale.expand(batch, heads).contiguous()) if fp8 else out


def qk_norm_rope(
    q, k, weight_q, weight_k, cos, sin, eps, heads_first=False, fp8=False, heads_per_program=16, num_warps=4
):
    """Same contract as `reference.qk_norm_rope`; `heads_per_program` and `num_warps` tune the launch."""
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return (
        _one(q, weight_q, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8),
        _one(k, weight_k, cos, sin, eps, heads_first, heads_per_program, num_warps, fp8),
    )
