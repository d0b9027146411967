"""Flash attention forward (non-causal, no mask) in Triton: one program per 128-row query tile and head, online
softmax in base 2 over key/value tiles, float32 accumulation. Full key tiles run unmasked; the ragged last tile
is masked once."""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _attend(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, seq_len, stride_kn, stride_vn, offs_n, qk_scale,
            MASKED: tl.constexpr, SCALE_QK: tl.constexpr, PRECISION: tl.constexpr):
    if MASKED:
        valid = (start_n + offs_n) < seq_len
        k = tl.load(k_ptrs + start_n * stride_kn, mask=valid[None, :], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
        v = tl.load(v_ptrs + start_n * stride_vn)
    qk = tl.dot(q, k, input_precision=PRECISION)
    if SCALE_QK:  # fp8: base-2 logits need sm_scale * log2(e) times the scales of q and k
        qk = qk * qk_scale
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, scale_ptr, seq_len, heads, sm_scale_log2,
                            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_kd,
                            stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            FP8: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // heads, bh % heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    qk_scale = sm_scale_log2
    if FP8:  # per-(batch, head) scales of q, k and v: x = x_fp8 * scale
        qk_scale = qk_scale * tl.load(scale_ptr + bh * 3) * tl.load(scale_ptr + bh * 3 + 1)
    else:  # fold the softmax scale into q once instead of into every logit tile
        q = (q.to(tl.float32) * sm_scale_log2).to(q_ptr.dtype.element_ty)
    k_ptrs = k_ptr + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = v_ptr + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, seq_len, stride_kn, stride_vn, offs_n,
                                qk_scale, MASKED=False, SCALE_QK=FP8, PRECISION=PRECISION)
    if full < seq_len:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_ptrs, v_ptrs, full, seq_len, stride_kn, stride_vn, offs_n,
                                qk_scale, MASKED=True, SCALE_QK=FP8, PRECISION=PRECISION)
    out = acc / l_i[:, None]
    if FP8:
        out = out * tl.load(scale_ptr + bh * 3 + 2)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def _launch(query, key, value, out, scales, fp8, block_m, block_n, num_warps, num_stages):
    batch, heads, seq_len, head_dim = query.shape
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"flash_attention supports head_dim 16..256 (powers of two), got {head_dim}.")
    grid = (triton.cdiv(seq_len, block_m), batch * heads)
    _flash_attention_kernel[grid](
        query, key, value, out, scales if scales is not None else query, seq_len, heads,
        (1.0 / math.sqrt(head_dim)) * 1.4426950408889634,
        *query.stride()[:3], *key.stride(), *value.stride(), *out.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, FP8=fp8, num_warps=num_warps, num_stages=num_stages,
        # float32 inputs get true float32 products (not TF32), so the kernel matches the float32 reference.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out


def flash_attention(query, key, value, *, out=None, block_m: int = 128, block_n: int = 64, num_warps: int = 8,
                    num_stages: int = 3):
    """Same contract as `reference.flash_attention` (any strides with a contiguous last dimension); `out`, a
    `(B, H, S, D)` view of any layout, receives the result (e.g. a transposed view of a `(B, S, H, D)` buffer)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query) if out is None else out
    return _launch(query, key, value, out, None, False, block_m, block_n, num_warps, num_stages)


def _quantize_heads(x):
    """`(B, H, S, D)` -> e4m3 values and one float32 scale per (batch, head)."""
    scale = x.abs().amax(dim=(2, 3)).float().clamp_min(1e-12) / 448.0
    return (x / scale[:, :, None, None].to(x.dtype)).to(torch.float8_e4m3fn), scale


def flash_attention_fp8(query, key, value, *, out=None, block_m: int = 128, block_n: int = 128,
                        num_warps: int = 8, num_stages: int = 3):
    """FP8 (e4m3) attention for the fast tier: q, k, v and the probabilities quantized per (batch, head), float32
    accumulation, output in q.dtype. V is stored transposed, as Hopper's FP8 MMA wants its B operand."""
    q8, sq = _quantize_heads(query)
    k8, sk = _quantize_heads(key)
    v8, sv = _quantize_heads(value)
    v8 = v8.transpose(-1, -2).contiguous().transpose(-1, -2)
    scales = torch.stack([sq, sk, sv], dim=-1).reshape(-1).contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    return _launch(q8, k8, v8, out, scales, True, block_m, block_n, num_warps, num_stages)
