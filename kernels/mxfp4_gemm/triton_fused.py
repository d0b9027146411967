"""MXFP4 GEMM with the E2M1 nibbles and E8M0 scales read and dequantized inside a tiled Triton GEMM, float32
accumulation (`fused_matmul`, tiles from `default_config`): the fallback for a few rows of any dtype (float32
activations)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels.mxfp4_gemm.triton_decode import weight_tile
from h3gen.kernels.mxfp4_gemm.triton_grid import auto_split, k_slices, program_tile, store_tile


@triton.jit
def _fused_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k], computed transposed (weight tile as the left operand, straight from
    registers), which suits a handful of rows: the rows become the MMA's narrow dimension."""
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        low, high = weight_tile(
            packed_ptr,
            scale_ptr,
            offs_n,
            n_ok,
            k0,
            k_stop,
            stride_pn,
            stride_sn,
            x_ptr.dtype.element_ty,
            BLOCK_N,
            BLOCK_K,
        )
        offs_k = tl.multiple_of(k0, 32) + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & (offs_k < k_stop)[None, :],
            other=0.0,
        )  # contiguous, vectorized
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        acc = tl.dot(low, tl.trans(x_even), acc, input_precision=PRECISION)
        acc = tl.dot(high, tl.trans(x_odd), acc, input_precision=PRECISION)
    store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, True, ATOMIC)


def default_config(m: int, n: int, k: int) -> dict:
    """Fused-kernel tile sizes for an `[m, k] x [k, n]` product of up to `triton.DEQUANT_MIN_ROWS` - 1 rows: 64
    outputs x 256 K per program, the best tile of an H200 sweep at 16 rows, with K split until enough weight bytes
    are in flight (`auto_split`)."""
    block_n, block_k = 64, 256
    return dict(
        block_m=16,
        block_n=block_n,
        block_k=block_k,
        split_k=auto_split(n, k, block_n, block_k),
        num_warps=4,
        num_stages=3,
    )


def fused_matmul(
    x,
    packed,
    scales,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """The in-kernel dequantizing GEMM with explicit tiles; `split_k` > 1 sums K slices with float32 atomics."""
    m, k = x.shape
    n = packed.shape[0]
    k_per_split, split_k, out = k_slices(x, n, split_k, block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _fused_kernel[grid](
        x,
        packed,
        scales,
        out,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ATOMIC=split_k > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.to(x.dtype)
