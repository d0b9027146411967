"""MXFP4 weights decoded to floats in Triton: single codes and scales (`e2m1_to_f32`, `e8m0_to_f32`), a weight
tile as the fused GEMM reads it (`weight_tile`), and the whole weight in one pass (`dequantize`).

Decoding by bit placement rather than arithmetic: a code's magnitude bits, placed at the bottom of a float32's (or
bfloat16's) exponent and the top of its mantissa, read as the E2M1 value times 2^-126; the E8M0 scale 2^(b - 127)
is the float with exponent field b."""

import torch
import triton
import triton.language as tl


@triton.jit
def e2m1_to_f32(code):
    """uint32 4-bit E2M1 codes (sign in bit 3) -> float32 values, exact: the code's exponent and mantissa bits go
    to the lowest exponent bits and the top mantissa bit, which reads as value * 2^-126 (e = 0 lands on the
    subnormal 2^-127 = 0.5 * 2^-126), so one multiply by 2^126 restores it."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def e8m0_to_f32(bits):
    """uint32 E8M0 scale bytes -> float32 2^(bits - 127); 255 is NaN."""
    scale = (bits << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bits == 0, 5.877471754111438e-39, scale)  # 2^-127 is a float32 subnormal
    return tl.where(bits == 255, float("nan"), scale)


@triton.jit
def weight_tile(
    packed_ptr,
    scale_ptr,
    offs_n,
    n_ok,
    k0,
    k_stop,
    stride_pn,
    stride_sn,
    dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Dequantized weight tile for elements k0 .. k0 + BLOCK_K of rows `offs_n`, as its even and odd elements:
    two `(BLOCK_N, BLOCK_K / 2)` tensors. Bytes and scales are read as `(rows, groups of 32, ...)` tiles so that
    one scale broadcasts over its 16 bytes in registers (no per-element scale loads)."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    group = tl.arange(0, GROUPS)
    offs_byte = tl.arange(0, 16)
    # k0 is a multiple of 32 (tiles and K slices are), so each group's bytes start 16-byte aligned: said to the
    # compiler, it lets the 16 bytes load as one vector.
    first = tl.multiple_of(k0 + 32 * group, 32)  # first element of each group
    # Masked per group, not per element, so the 16 bytes of a group load as one vector: a group straddling the
    # input width reads the zero padding of the stored width, and the activations beyond it are masked to zero.
    group_ok = n_ok[:, None, None] & (first < k_stop)[None, :, None]
    byte = tl.load(
        packed_ptr
        + offs_n[:, None, None] * stride_pn
        + tl.multiple_of(first // 2, 16)[None, :, None]
        + offs_byte[None, None, :],
        mask=group_ok,
        other=0,
    ).to(tl.uint32)
    scale_bits = tl.load(
        scale_ptr + offs_n[:, None, None] * stride_sn + (first // 32)[None, :, None], mask=group_ok, other=127
    ).to(tl.uint32)
    scale = e8m0_to_f32(scale_bits)
    low = tl.reshape((e2m1_to_f32(byte & 15) * scale).to(dtype), (BLOCK_N, BLOCK_K // 2))
    high = tl.reshape((e2m1_to_f32(byte >> 4) * scale).to(dtype), (BLOCK_N, BLOCK_K // 2))
    return low, high


@triton.jit
def _dequantize_kernel(
    packed_ptr, scale_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    low, high = weight_tile(
        packed_ptr,
        scale_ptr,
        offs_n,
        n_ok,
        pid_k * BLOCK_K,
        K,
        stride_pn,
        stride_sn,
        out_ptr.dtype.element_ty,
        BLOCK_N,
        BLOCK_K,
    )
    out = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # even elements first, as stored
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], out, mask=n_ok[:, None] & (offs_k < K)[None, :])


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    in_features: int,
    *,
    block_n: int = 16,
    block_k: int = 512,
    num_warps: int = 4,
) -> torch.Tensor:
    """(`[N, Kp / 2]` uint8, `[N, Kp / 32]` uint8) -> `[N, in_features]` in `dtype`; same values as
    `h3gen.quant.mxfp4_format.dequantize`."""
    n = packed.shape[0]
    out = torch.empty((n, in_features), dtype=dtype, device=packed.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(in_features, block_k))
    _dequantize_kernel[grid](
        packed,
        scales,
        out,
        n,
        in_features,
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out
