"""MXFP4-weight GEMM in Triton, two paths:

- fused: the weight's E2M1 nibbles and E8M0 scales are read and dequantized inside the GEMM (no dequantized copy in
  memory), multiplied with the activations' tile, float32 accumulation. Reading 4.25 bits per weight instead of 16
  is what makes it fast when the GEMM is bound by weight bandwidth (decode, M up to a few hundred rows).
- dequantize + cuBLAS: for thousands of rows the GEMM is bound by tensor-core throughput, and rebuilding every weight
  tile once per row tile costs more than writing the whole bf16 weight once (about 0.1 ms for the largest H3
  weight) and handing it to cuBLAS. The bf16 copy lives only for the call.

Decoding E2M1 by bit construction rather than arithmetic: a code (sign s, exponent e, mantissa m) is the float32
with exponent field e + 126 and top mantissa bit m when e > 0, and m * 0.5 (exponent field 126) when e = 0. The
E8M0 scale 2^(b - 127) is the float32 with exponent field b.
"""

import torch
import triton
import triton.language as tl

# Rows at and above which `mxfp4_matmul` dequantizes once and calls cuBLAS (measured on the H200, RESULTS.md).
DEQUANT_MIN_ROWS = 1024


@triton.jit
def _e2m1_to_f32(code):
    """uint32 4-bit E2M1 codes (sign in bit 3) -> float32 values, exact."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    magnitude = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    return (magnitude | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_f32(bits):
    """uint32 E8M0 scale bytes -> float32 2^(bits - 127); 255 is NaN."""
    scale = (bits << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bits == 0, 5.877471754111438e-39, scale)  # 2^-127 is a float32 subnormal
    return tl.where(bits == 255, float("nan"), scale)


@triton.jit
def _fused_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_pn, stride_sn,
                  stride_om, stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE: tl.constexpr, ATOMIC: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & ((k0 + offs_k) < k_stop)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        even_ok = (k0 + 2 * offs_byte) < k_stop
        byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (k0 // 2 + offs_byte)[None, :],
                       mask=n_ok[:, None] & even_ok[None, :], other=0).to(tl.uint32)
        # The scale of element k0 + 2j is byte (k0 + 2j) // 32: read once per 16 bytes, broadcast by the cache.
        scale_bits = tl.load(scale_ptr + offs_n[:, None] * stride_sn + ((k0 + 2 * offs_byte) // 32)[None, :],
                             mask=n_ok[:, None] & even_ok[None, :], other=127).to(tl.uint32)
        scale = _e8m0_to_f32(scale_bits)
        w_even = (_e2m1_to_f32(byte & 15) * scale).to(x.dtype)
        w_odd = (_e2m1_to_f32(byte >> 4) * scale).to(x.dtype)
        if IEEE:
            acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(w_even))
            acc += tl.dot(x_odd, tl.trans(w_odd))
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_even = pid_k * BLOCK_K + 2 * tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < N
    byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (offs_even // 2)[None, :],
                   mask=n_ok[:, None] & (offs_even < K)[None, :], other=0).to(tl.uint32)
    scale = _e8m0_to_f32(tl.load(scale_ptr + offs_n[:, None] * stride_sn + (offs_even // 32)[None, :],
                                 mask=n_ok[:, None] & (offs_even < K)[None, :], other=127).to(tl.uint32))
    w_even = (_e2m1_to_f32(byte & 15) * scale).to(out_ptr.dtype.element_ty)
    w_odd = (_e2m1_to_f32(byte >> 4) * scale).to(out_ptr.dtype.element_ty)
    out = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))  # even elements first, as stored
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], out,
             mask=n_ok[:, None] & (offs_k < K)[None, :])


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, in_features: int) -> torch.Tensor:
    """(`[N, Kp / 2]` uint8, `[N, Kp / 32]` uint8) -> `[N, in_features]` in `dtype`; same values as
    `h3gen.quant.mxfp4.dequantize`."""
    n = packed.shape[0]
    out = torch.empty((n, in_features), dtype=dtype, device=packed.device)
    block_n, block_k = 32, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(in_features, block_k))
    _dequantize_kernel[grid](packed, scales, out, n, in_features, packed.stride(0), scales.stride(0), out.stride(0),
                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_split(n: int, k: int, block_n: int, block_k: int, device) -> int:
    """K slices for a small-M product: enough programs for two per SM, each slice at least 4 K tiles long."""
    tiles = triton.cdiv(n, block_n)
    return max(1, min(8, (2 * _sm_count(device)) // tiles, k // (4 * block_k)))


def default_config(m: int, n: int, k: int, device) -> dict:
    """Fused-kernel tile sizes for an `[m, k] x [k, n]` product (tuned on the H200, RESULTS.md): small M streams the
    weight with narrow N tiles and enough programs (splitting K when N alone gives too few) to keep every SM
    reading; larger M uses tensor-core sized tiles."""
    if m <= 16:
        block_n, block_k = 32, 256
        return dict(block_m=16, block_n=block_n, block_k=block_k, split_k=auto_split(n, k, block_n, block_k, device),
                    num_warps=4, num_stages=4)
    if m <= 128:
        return dict(block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3)


def fused_matmul(x, packed, scales, *, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                 num_warps: int = 4, num_stages: int = 3):
    """The in-kernel dequantizing GEMM with explicit tiles; `split_k` > 1 sums K slices with float32 atomics."""
    m, k = x.shape
    n = packed.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    atomic = split_k > 1
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if atomic else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _fused_kernel[grid](x, packed, scales, out, m, n, k, k_per_split, x.stride(0), packed.stride(0),
                        scales.stride(0), out.stride(0), 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        IEEE=x.dtype == torch.float32, ATOMIC=atomic, num_warps=num_warps, num_stages=num_stages)
    return out.to(x.dtype) if atomic else out


def mxfp4_matmul(x, packed, scales, *, path: str = "auto", **config):
    """Same contract as `reference.mxfp4_matmul`: `x` `[M, K]` (bf16/fp16/fp32) times the dequantized `[N, Kp]`
    weight (`packed` `[N, Kp / 2]`, `scales` `[N, Kp / 32]` uint8) transposed -> `[M, N]` in x.dtype.

    `path`: "fused" (in-kernel dequantization), "dequant" (dequantize then `torch.matmul`) or "auto" (fused below
    `DEQUANT_MIN_ROWS` rows). `config` overrides `default_config`'s tiles for the fused path."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    if path == "dequant" or (path == "auto" and m >= DEQUANT_MIN_ROWS and not config):
        return x @ dequantize(packed, scales, x.dtype, k).t()
    return fused_matmul(x, packed, scales, **{**default_config(m, n, k, x.device), **config})
