"""MXFP4 GEMM through Triton's microscaling dot (`scaled_matmul`, `tl.dot_scaled`): the stored E2M1 codes and
E8M0 scales go into the tensor cores as they are, with bf16 or fp16 activations; `mxfp4_matmul`'s choice for 2-16
rows of fp16."""

import torch
import triton
import triton.language as tl

from h3gen.kernels.mxfp4_gemm.triton_grid import auto_split, k_slices, program_tile, store_tile


@triton.jit
def _scaled_dot_kernel(
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
    X_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] through Triton's microscaling dot (`tl.dot_scaled`: the E2M1 codes and
    E8M0 scales go in as stored and are widened on the way into the tensor cores), computed transposed: the
    weight is the left operand and the few rows of x the narrow right one."""
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        # Bytes beyond the input width are the stored zero padding (and x is zero there): the byte mask only
        # guards the stored width, which is a multiple of 16, so the loads stay 16-byte vectors.
        offs_b = tl.multiple_of(k0 // 2, 16) + tl.arange(0, BLOCK_K // 2)
        weight = tl.load(
            packed_ptr + offs_n[:, None] * stride_pn + offs_b[None, :],
            mask=n_ok[:, None] & (offs_b < packed_width)[None, :],
            other=0,
        )
        offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale = tl.load(
            scale_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=n_ok[:, None] & (offs_g < packed_width // 16)[None, :],
            other=127,
        )
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_t = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
            mask=m_ok[None, :] & (offs_k < k_stop)[:, None],
            other=0.0,
        )
        acc = tl.dot_scaled(weight, scale, "e2m1", x_t, None, X_FORMAT, acc)
    store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, True, ATOMIC)


SCALED_DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def scaled_matmul(
    x,
    packed,
    scales,
    *,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 256,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """The product through `tl.dot_scaled` (bf16 or fp16 activations); `split_k` > 1 (default: enough K slices to
    keep weight bytes in flight, see `auto_split`) sums K slices with float32 atomics."""
    if x.dtype not in SCALED_DOT_FORMATS:
        raise ValueError(f"the scaled-dot path takes bf16 or fp16 activations, got {x.dtype}.")
    m, k = x.shape
    n = packed.shape[0]
    k_per_split, split_k, out = k_slices(x, n, split_k or auto_split(n, k, block_n, block_k), block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _scaled_dot_kernel[grid](
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
        X_FORMAT=SCALED_DOT_FORMATS[x.dtype],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ATOMIC=split_k > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.to(x.dtype)
