"""MXFP4-weight GEMM in Triton. Paths, by rows of activations (`mxfp4_matmul` picks):

- 1-16 rows of bf16 on a CUDA GPU with K a multiple of 128, `few_rows` (`kernels.mxfp4_gemm.gluon`, written in
  Gluon): the packed words loaded straight into the MMA's operand registers, no shared memory; 1.4-2.1x bf16
  cuBLAS at the H3 shapes on the H200, ahead of the two paths below (benchmarks/RESULTS.md). The paths below remain
  for the other cases and for the interpreter.
- one row, `gemv`: CUDA-core products with the weights decoded from 32-bit words (three integer operations per
  weight); bound by the decode's integer issue rate, faster than bf16 cuBLAS there.
- 2-16 rows of bf16, `pair_matmul`: tensor cores, each word decoded by inline PTX into bf16 pairs already in the
  MMA's operand registers. fp16 takes the `tl.dot_scaled` path (`scaled_matmul`).
- fused (`fused_matmul`): the E2M1 nibbles and E8M0 scales read and dequantized inside a tiled GEMM, float32
  accumulation; the fallback for a few rows of any dtype (float32 activations).
- dequantize + cuBLAS: for thousands of rows the GEMM is bound by tensor-core throughput, and rebuilding every weight
  tile once per row tile costs more than writing the whole bf16 weight once (about 0.1 ms for the largest H3
  weight) and handing it to cuBLAS. The bf16 copy lives only for the call.

Decoding by bit placement rather than arithmetic: a code's magnitude bits, placed at the bottom of a float32's (or
bfloat16's) exponent and the top of its mantissa, read as the E2M1 value times 2^-126; the E8M0 scale 2^(b - 127)
is the float with exponent field b.
"""

import os

import torch
import triton
import triton.language as tl

from h3gen.kernels.mxfp4_gemm import gluon
from h3gen.kernels.mxfp4_gemm.ptx import WIDEN_CODES

# Rows at and above which `mxfp4_matmul` dequantizes once and calls cuBLAS (measured on the H200,
# benchmarks/history.md).
DEQUANT_MIN_ROWS = 17
# Tiles of the `tl.dot_scaled` path for 2-16 rows of fp16 activations (bf16 takes `pair_matmul`, 1.4-2x faster on
# the H200): 1.15-1.23x the fused kernel there (benchmarks/history.md); at 256 rows and more it is 10x slower than
# cuBLAS.
SCALED_SMALL_M = dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)


@triton.jit
def _e2m1_to_f32(code):
    """uint32 4-bit E2M1 codes (sign in bit 3) -> float32 values, exact: the code's exponent and mantissa bits go
    to the lowest exponent bits and the top mantissa bit, which reads as value * 2^-126 (e = 0 lands on the
    subnormal 2^-127 = 0.5 * 2^-126), so one multiply by 2^126 restores it."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _e8m0_to_f32(bits):
    """uint32 E8M0 scale bytes -> float32 2^(bits - 127); 255 is NaN."""
    scale = (bits << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bits == 0, 5.877471754111438e-39, scale)  # 2^-127 is a float32 subnormal
    return tl.where(bits == 255, float("nan"), scale)


@triton.jit
def _weight_tile(
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
    scale = _e8m0_to_f32(scale_bits)
    low = tl.reshape((_e2m1_to_f32(byte & 15) * scale).to(dtype), (BLOCK_N, BLOCK_K // 2))
    high = tl.reshape((_e2m1_to_f32(byte >> 4) * scale).to(dtype), (BLOCK_N, BLOCK_K // 2))
    return low, high


# Row-times-vector products (one row of activations, decode-time expert GEMVs) are bound by the integer work of
# decoding, not by the tensor cores, so they decode from 32-bit words of eight codes with three integer operations per
# weight (isolate the code, one multiply that copies it to bits 22-25 and 28-31, keep magnitude and sign) where the
# byte-wise `_weight_tile` takes about eight. The decoded float32 is the E2M1 value times 2^-126 and x carries 2^64,
# so the products are normal floats for |x| in [2^-64, 2^64]; each group's sum gets 2^62 back before its scale.
WORD_X_SCALE = 18446744073709551616.0  # 2^64


@triton.jit
def _word_code(words, words_high, i: tl.constexpr):
    """Code i (bits 4i .. 4i + 3) of uint32 `words` (`words_high` = words >> 16) -> float32 E2M1 value * 2^-126."""
    source = words if i < 4 else words_high
    j: tl.constexpr = i % 4
    code = source & (15 << (4 * j))
    copies = code * ((1 << (22 - 4 * j)) + (1 << (28 - 4 * j)))
    return (copies & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _x_column(x8, i: tl.constexpr, WORDS: tl.constexpr):
    """Column i of `x8` `(WORDS, 8)`: the activations that meet code i of each word (element i = 4a + 2b + c)."""
    c0, c1 = tl.split(tl.reshape(x8, (WORDS, 2, 2, 2)))
    b0, b1 = tl.split(c0 if i % 2 == 0 else c1)
    a0, a1 = tl.split(b0 if (i // 2) % 2 == 0 else b1)
    return a0 if i // 4 == 0 else a1


@triton.jit
def _word_rows_dot(packed_ptr, scale_ptr, offs_n, n_ok, k0, k_stop, stride_pn, stride_sn, x8, WORDS: tl.constexpr):
    """Partial products of rows `offs_n` with elements k0 .. k0 + 8 WORDS: `x8` `(WORDS, 8)` float32 activations
    times `WORD_X_SCALE` (zero beyond `k_stop`) -> `(BLOCK_N, WORDS / 4)` float32, one sum per group of 32.
    `packed_ptr` rows are read as 16-byte vectors of uint32 words (`stride_pn` bytes, a multiple of 16)."""
    GROUPS: tl.constexpr = WORDS // 4
    offs_w = tl.arange(0, WORDS)
    group_of_word = k0 // 32 + offs_w // 4  # masked per group of four words, so they load as one 16-byte vector
    ok = n_ok[:, None] & (group_of_word * 32 < k_stop)[None, :]
    words_ptr = packed_ptr.to(tl.pointer_type(tl.uint32))
    row_words = tl.multiple_of(offs_n * (stride_pn // 4), 4)  # rows are whole 16-byte vectors (`word_rows`)
    words = tl.load(words_ptr + row_words[:, None] + tl.multiple_of(k0 // 8, 4) + offs_w[None, :], mask=ok, other=0)
    words_high = words >> 16
    part = _word_code(words, words_high, 0) * _x_column(x8, 0, WORDS)[None, :]
    part += _word_code(words, words_high, 1) * _x_column(x8, 1, WORDS)[None, :]
    part += _word_code(words, words_high, 2) * _x_column(x8, 2, WORDS)[None, :]
    part += _word_code(words, words_high, 3) * _x_column(x8, 3, WORDS)[None, :]
    part += _word_code(words, words_high, 4) * _x_column(x8, 4, WORDS)[None, :]
    part += _word_code(words, words_high, 5) * _x_column(x8, 5, WORDS)[None, :]
    part += _word_code(words, words_high, 6) * _x_column(x8, 6, WORDS)[None, :]
    part += _word_code(words, words_high, 7) * _x_column(x8, 7, WORDS)[None, :]
    offs_g = k0 // 32 + tl.arange(0, GROUPS)
    scale = _e8m0_to_f32(
        tl.load(
            scale_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=n_ok[:, None] & (offs_g * 32 < k_stop)[None, :],
            other=127,
        ).to(tl.uint32)
    )
    return tl.sum(tl.reshape(part, (part.shape[0], GROUPS, 4)), axis=2) * 4611686018427387904.0 * scale  # 2^62


@triton.jit
def _word_x(x_ptr, k0, k_stop, WORDS: tl.constexpr):
    """Activations k0 .. k0 + 8 WORDS of one row as `(WORDS, 8)` float32 times `WORD_X_SCALE`, zero from k_stop."""
    ks = k0 + tl.arange(0, WORDS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return tl.load(x_ptr + ks, mask=ks < k_stop, other=0.0).to(tl.float32) * 18446744073709551616.0


@triton.jit
def _program_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and outputs (with their in-range masks) and its K slice [k_start, k_stop), for the grid
    (row tiles, output tiles, K slices) the GEMM kernels share."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, TRANSPOSED: tl.constexpr, ATOMIC: tl.constexpr):
    """Write a program's float32 `acc` (`(rows, outputs)`, or `(outputs, rows)` when `TRANSPOSED`) to the `[M, N]`
    output: added atomically when K slices share it, else cast to the output's dtype."""
    if TRANSPOSED:
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
    else:
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = _program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        low, high = _weight_tile(
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
    _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, True, ATOMIC)


@triton.jit
def _gemv_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    out_ptr,
    N,
    K,
    k_per_split,
    stride_pn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """One row of activations: out[n] = sum_k x[k] w[n, k] with CUDA-core FMAs (no MMA, no operand shuffles), the
    weight decoded from 32-bit words (`_word_rows_dot`)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, 8 * WORDS):
        x8 = _word_x(x_ptr, k0, k_stop, WORDS)
        acc += _word_rows_dot(packed_ptr, scale_ptr, offs_n, n_ok, k0, k_stop, stride_pn, stride_sn, x8, WORDS)
    total = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, total, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


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
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = _program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
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
    _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, True, ATOMIC)


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
        value = _e8m0_to_f32(scale.to(tl.uint32))
        codes = byte.to(tl.uint32)
        low = (_e2m1_to_f32(codes & 15) * value).to(dtype)
        high = (_e2m1_to_f32(codes >> 4) * value).to(dtype)
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
    offs_m, offs_n, m_ok, n_ok, k_start, k_stop = _program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
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
    _store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, False, ATOMIC)


@triton.jit
def _dequantize_kernel(
    packed_ptr, scale_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    low, high = _weight_tile(
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


# Packed weight bytes a small-M product should have requested at any moment to keep HBM busy (bandwidth x latency
# on the H200 is about 4 MB). Each program reads one (block_n, block_k / 2) byte tile per step, so all programs
# together have about N * block_k / 2 bytes in flight; splitting K multiplies that.
IN_FLIGHT_BYTES = 6 << 20


def auto_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """K slices for a small-M product: enough for `IN_FLIGHT_BYTES` in flight, each slice at least 2 K tiles."""
    wanted = triton.cdiv(IN_FLIGHT_BYTES, n * block_k // 2)
    return max(1, min(8, wanted, k // (2 * block_k)))


def default_config(m: int, n: int, k: int) -> dict:
    """Fused-kernel tile sizes for an `[m, k] x [k, n]` product of up to `DEQUANT_MIN_ROWS` - 1 rows (swept on the
    H200, benchmarks/history.md): K split until enough weight bytes are in flight."""
    block_n, block_k = 64, 256
    return dict(
        block_m=16,
        block_n=block_n,
        block_k=block_k,
        split_k=auto_split(n, k, block_n, block_k),
        num_warps=4,
        num_stages=3,
    )


def _k_slices(x, n: int, split_k: int, block_k: int) -> tuple[int, int, torch.Tensor]:
    """K cut into about `split_k` slices of whole tiles: (elements per slice, slices, output). With several slices
    the output is float32 zeros they add into atomically (the caller casts it back), else the result itself."""
    m, k = x.shape
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    slices = triton.cdiv(k, k_per_split)
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if slices > 1
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    return k_per_split, slices, out


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
    k_per_split, split_k, out = _k_slices(x, n, split_k, block_k)
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
    k_per_split, split_k, out = _k_slices(x, n, split_k or auto_split(n, k, block_n, block_k), block_k)
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
    The default tile was within 7 % of the best of a sweep at every H3 shape for 8 and 16 rows on the H200
    (benchmarks/history.md); `split_k` > 1 sums K slices with float32 atomics."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if k % 8:
        raise ValueError(f"the pair path reads activations 8 at a time: K = {k} is not a multiple of 8.")
    if m > 16 or block_k % 32:
        raise ValueError(f"the pair path takes up to 16 rows and block_k a multiple of 32 (got {m} rows, {block_k}).")
    n = packed.shape[0]
    k_per_split, split_k, out = _k_slices(x, n, split_k, block_k)
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


def word_rows(packed: torch.Tensor) -> torch.Tensor:
    """`packed` as the word-decoding kernels read it: rows of whole 16-byte vectors, 16-byte aligned (the stored
    format pads rows to 16 bytes; a view that is not aligned gets copied)."""
    if packed.stride(-1) != 1 or any(s % 16 for s in packed.stride()[:-1]) or packed.data_ptr() % 16:
        packed = packed.contiguous()
    if packed.shape[-1] % 16:
        raise ValueError(
            f"MXFP4 rows of {packed.shape[-1]} bytes are not whole 16-byte vectors (the format pads "
            "rows to 16 bytes, K to a multiple of 32)."
        )
    return packed


def gemv(
    x,
    packed,
    scales,
    *,
    block_n: int = 16,
    block_k: int = 512,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """`x` `[1, K]` times the dequantized weight transposed -> `[1, N]` without tensor cores; `block_k` (a multiple
    of 32) elements per step. The default tile was within 4 % of the best of a sweep at every H3 shape on the H200
    (benchmarks/history.md: 1.37-1.64x bf16 cuBLAS, graphed)."""
    if block_k % 32:
        raise ValueError(f"the gemv path reads whole groups of 32: block_k {block_k} is not a multiple of 32.")
    packed = word_rows(packed)
    k, n = x.shape[1], packed.shape[0]
    k_per_split, split_k, out = _k_slices(x, n, split_k or auto_split(n, k, block_n, block_k), block_k)
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x,
        packed,
        scales,
        out,
        n,
        k,
        k_per_split,
        packed.stride(0),
        scales.stride(0),
        BLOCK_N=block_n,
        WORDS=block_k // 8,
        ATOMIC=split_k > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.to(x.dtype)


def mxfp4_matmul(x, packed, scales, *, path: str = "auto", **config):
    """Same contract as `reference.mxfp4_matmul`: `x` `[M, K]` (bf16/fp16/fp32) times the dequantized `[N, Kp]`
    weight (`packed` `[N, Kp / 2]`, `scales` `[N, Kp / 32]` uint8) transposed -> `[M, N]` in x.dtype.

    `path`: "few_rows" (1-16 rows of bf16, Gluon: `gluon.few_rows_matmul`), "fused" (in-kernel dequantization),
    "gemv" (one row, no tensor cores), "pairs" (up to 16 rows on the tensor cores, `pair_matmul`), "scaled"
    (`tl.dot_scaled`, bf16/fp16 activations), "dequant" (dequantize then `torch.matmul`) or "auto" (up to 16 rows of
    bf16 where `gluon.supports` them: few_rows; else one row: the GEMV; up to `DEQUANT_MIN_ROWS` rows: pairs for
    bf16 with K a multiple of 8, the scaled dot for fp16, else fused; more: dequant). `config` overrides the
    chosen path's tiles."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    if path == "few_rows" or (
        path == "auto" and m <= gluon.MAX_ROWS and not config and gluon.supports(x, packed, scales)
    ):
        return gluon.few_rows_matmul(x, packed, scales, **config)
    if path == "gemv" or (path == "auto" and m == 1):
        if m != 1:
            raise ValueError(f"the gemv path takes one row of activations, got {m}.")
        return gemv(x, packed, scales, **config)
    if path == "pairs" or (
        path == "auto" and 1 < m < DEQUANT_MIN_ROWS and x.dtype == torch.bfloat16 and k % 8 == 0 and not config
    ):
        return pair_matmul(x, packed, scales, **config)
    if path == "scaled":
        return scaled_matmul(x, packed, scales, **config)
    if path == "auto" and m < DEQUANT_MIN_ROWS and x.dtype in SCALED_DOT_FORMATS and not config:
        return scaled_matmul(x, packed, scales, **SCALED_SMALL_M)
    if path == "dequant" or (path == "auto" and m >= DEQUANT_MIN_ROWS and not config):
        return x @ dequantize(packed, scales, x.dtype, k).t()
    return fused_matmul(x, packed, scales, **{**default_config(m, n, k), **config})
