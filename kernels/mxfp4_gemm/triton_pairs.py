"""MXFP4 GEMM for 2-16 rows of bf16 on the tensor cores (`pair_matmul`): each 32-bit word of the packed weight is
decoded by inline PTX into bf16 pairs already in the MMA's operand registers; other dtypes decode by plain Triton
arithmetic, which is how the Triton interpreter runs it."""

import os

import torch
import triton
import triton.language as tl

from h3gen.kernels.mxfp4_gemm.ptx import WIDEN_CODES
from h3gen.kernels.mxfp4_gemm.triton_decode import e2m1_to_f32, e8m0_to_f32
from h3gen.kernels.mxfp4_gemm.triton_grid import k_slices, program_tile, store_tile

# Tensor-core path for a few rows of bf16 activations ("pairs"): each 32-bit word of eight codes becomes four bf16x2
# registers with about two integer operations per weight, straight in the MMA's operand registers (`ptx.WIDEN_CODES`),
# then * the group scale 2^(s - 127) as bf16 (s = 0: the subnormal 2^-127, s = 255: NaN). Registers: $0 $1 = low
# codes of bytes (0, 1), (2, 3); $2 $3 = their high codes; $4 = the four bytes; $5 = the scale byte.
PAIR_DECODE_ASM = tl.constexpr(
    """
{
.reg .b32 m, f;
.reg .pred p;
mul.lo.u32 m, $5, 0x00800080;
add.u32 f, $5, 1;
and.b32 f, f, 0xFE;
setp.eq.u32 p, f, 0;
@p or.b32 m, m, 0x00400040;
{"""
    + WIDEN_CODES
    + """
mul.rn.bf16x2 $0, a, m;
mul.rn.bf16x2 $1, b, m;
mul.rn.bf16x2 $2, c, m;
mul.rn.bf16x2 $3, d, m;
}
}
"""
)


@triton.jit
def _pair_weight_tile(
    packed_ptr,
    scale_ptr,
    offs_n,
    n_ok,
    k0,
    packed_width,
    stride_pn,
    stride_sn,
    dtype: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Dequantized weight tile `(BLOCK_N, BLOCK_K)` for elements k0 .. k0 + BLOCK_K, its K order permuted within
    each 8 as [0, 2, 4, 6, 1, 3, 5, 7] (the low codes of a word's four bytes, then the high codes: the order
    `PAIR_DECODE_ASM` produces them in). `ASM` decodes by the inline PTX (bf16 only); otherwise by plain Triton
    arithmetic in `dtype` (the interpreter)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    first_byte = tl.multiple_of(k0 // 2, 16) + 16 * tl.arange(0, GROUPS)
    group_ok = n_ok[:, None] & (first_byte < packed_width)[None, :]  # whole 16-byte groups: vector loads
    byte = tl.load(
        packed_ptr + offs_n[:, None, None] * stride_pn + first_byte[None, :, None] + tl.arange(0, 16)[None, None, :],
        mask=group_ok[:, :, None],
        other=0,
    )
    scale = tl.load(
        scale_ptr + offs_n[:, None] * stride_sn + (k0 // 32 + tl.arange(0, GROUPS))[None, :], mask=group_ok, other=127
    ).to(tl.int32)
    byte = tl.reshape(byte, (BLOCK_N, BLOCK_K // 8, 4))
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, BLOCK_K // 8, 4))
    if ASM:
        low, high = tl.inline_asm_elementwise(
            PAIR_DECODE_ASM,
            "=r,=r,=r,=r,r,r,r,r,r",
            [byte, scale],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        value = e8m0_to_f32(scale.to(tl.uint32))
        codes = byte.to(tl.uint32)
        low = (e2m1_to_f32(codes & 15) * value).to(dtype)
        high = (e2m1_to_f32(codes >> 4) * value).to(dtype)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


@triton.jit
def _pair_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    packed_width,
    k_per_split,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    ASM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] for a few rows: x `(BLOCK_M, BLOCK_K)` tiles as the MMA's left operand, the
    weight tile decoded straight into the right operand's registers; K % 8 == 0 (x's masks are per 8 elements)."""
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    k_stop = tl.multiple_of(k_stop, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        w = _pair_weight_tile(
            packed_ptr,
            scale_ptr,
            offs_n,
            n_ok,
            k0,
            packed_width,
            stride_pn,
            stride_sn,
            x_ptr.dtype.element_ty,
            ASM,
            BLOCK_N,
            BLOCK_K,
        )
        offs_k = tl.multiple_of(k0, 32) + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & (offs_k < k_stop)[None, :],
            other=0.0,
        )
        # the weight tile's K order: [0, 2, 4, 6, 1, 3, 5, 7] within each 8
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 4, 2)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, False, ATOMIC)


def pair_matmul(
    x,
    packed,
    scales,
    *,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 4,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """The product for a few rows on the tensor cores, the weights decoded by `PAIR_DECODE_ASM` (bf16 activations;
    other dtypes decode by plain Triton arithmetic, which is how the interpreter runs it). K must be a multiple of 8.
    The default tile was within 7 % of the best of a sweep at every H3 shape for 8 and 16 rows on the H200;
    `split_k` > 1 sums K slices with float32 atomics."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if k % 8:
        raise ValueError(f"the pair path reads activations 8 at a time: K = {k} is not a multiple of 8.")
    if m > 16 or block_k % 32:
        raise ValueError(f"the pair path takes up to 16 rows and block_k a multiple of 32 (got {m} rows, {block_k}).")
    n = packed.shape[0]
    k_per_split, split_k, out = k_slices(x, n, split_k, block_k)
    asm = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"
    grid = (1, triton.cdiv(n, block_n), split_k)
    _pair_kernel[grid](
        x,
        packed,
        scales,
        out,
        m,
        n,
        k,
        packed.shape[1],
        k_per_split,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        ASM=asm,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ATOMIC=split_k > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.to(x.dtype)
