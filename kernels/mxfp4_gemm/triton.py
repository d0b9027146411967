"""MXFP4-weight GEMM: the weight's E2M1 nibbles and E8M0 scales are read and dequantized inside the kernel (no
dequantized copy in memory), multiplied with the activations' tile, float32 accumulation."""

import torch
import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """4-bit E2M1 codes -> float32 values (sign in bit 3)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _mxfp4_matmul_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn,
                         stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kh = tl.arange(0, BLOCK_K // 2)  # packed bytes of one K tile
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (k0 // 2 + offs_kh)[None, :],
                       mask=(offs_n[:, None] < N) & ((k0 + 2 * offs_kh) < K)[None, :], other=0).to(tl.int32)
        codes = tl.interleave(byte & 0xF, byte >> 4)  # (BLOCK_N, BLOCK_K): even elements in the low nibbles
        scale_bits = tl.load(scale_ptr + offs_n[:, None] * stride_sn + (k0 // 32 + offs_s)[None, :],
                             mask=(offs_n[:, None] < N) & ((k0 + 32 * offs_s) < K)[None, :], other=127)
        scale = tl.where(scale_bits == 255, float("nan"), tl.exp2(scale_bits.to(tl.float32) - 127.0))
        weight = tl.reshape(tl.reshape(_e2m1(codes), (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None],
                            (BLOCK_N, BLOCK_K))
        weight = tl.where(k_ok[None, :], weight, 0.0)
        acc += tl.dot(x.to(tl.float32) if x.dtype == tl.float32 else x, tl.trans(weight).to(x.dtype),
                      input_precision="ieee" if x.dtype == tl.float32 else "tf32")
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def mxfp4_matmul(x, packed, scales, *, block_m: int | None = None, block_n: int = 64, block_k: int = 64,
                 num_warps: int = 4, num_stages: int = 3):
    """Same contract as `reference.mxfp4_matmul`. Small M (decode) uses 16-row tiles."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    block_m = block_m or (16 if m <= 16 else 64)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mxfp4_matmul_kernel[grid](x, packed, scales, out, m, n, k, x.stride(0), packed.stride(0), scales.stride(0),
                               out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               num_warps=num_warps, num_stages=num_stages)
    return out
