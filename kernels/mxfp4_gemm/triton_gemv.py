"""One row of activations times MXFP4 weights without tensor cores (`gemv`): CUDA-core products with the weights
decoded from 32-bit words of eight codes, bound by the decode's integer issue rate and faster than bf16 cuBLAS
there. The word decode (`word_rows`, `word_x`, `word_rows_dot`) also serves the MoE expert GEMVs
(`kernels.moe.triton_mxfp4`)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels.mxfp4_gemm.triton_decode import e8m0_to_f32
from h3gen.kernels.mxfp4_gemm.triton_grid import auto_split, k_slices

# Row-times-vector products (one row of activations, decode-time expert GEMVs) are bound by the integer work of
# decoding, not by the tensor cores, so they decode from 32-bit words of eight codes with three integer operations per
# weight (isolate the code, one multiply that copies it to bits 22-25 and 28-31, keep magnitude and sign) where the
# byte-wise `weight_tile` takes about eight. The decoded float32 is the E2M1 value times 2^-126 and x carries 2^64,
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
def word_rows_dot(packed_ptr, scale_ptr, offs_n, n_ok, k0, k_stop, stride_pn, stride_sn, x8, WORDS: tl.constexpr):
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
    scale = e8m0_to_f32(
        tl.load(
            scale_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=n_ok[:, None] & (offs_g * 32 < k_stop)[None, :],
            other=127,
        ).to(tl.uint32)
    )
    return tl.sum(tl.reshape(part, (part.shape[0], GROUPS, 4)), axis=2) * 4611686018427387904.0 * scale  # 2^62


@triton.jit
def word_x(x_ptr, k0, k_stop, WORDS: tl.constexpr):
    """Activations k0 .. k0 + 8 WORDS of one row as `(WORDS, 8)` float32 times `WORD_X_SCALE`, zero from k_stop."""
    ks = k0 + tl.arange(0, WORDS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    return tl.load(x_ptr + ks, mask=ks < k_stop, other=0.0).to(tl.float32) * 18446744073709551616.0


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
    weight decoded from 32-bit words (`word_rows_dot`)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, 8 * WORDS):
        x8 = word_x(x_ptr, k0, k_stop, WORDS)
        acc += word_rows_dot(packed_ptr, scale_ptr, offs_n, n_ok, k0, k_stop, stride_pn, stride_sn, x8, WORDS)
    total = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, total, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


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
    of 32) elements per step. The default tile was within 4 % of the best of a sweep at every H3 shape on the H200,
    where it ran at 1.37-1.64x bf16 cuBLAS (graphed)."""
    if block_k % 32:
        raise ValueError(f"the gemv path reads whole groups of 32: block_k {block_k} is not a multiple of 32.")
    packed = word_rows(packed)
    k, n = x.shape[1], packed.shape[0]
    k_per_split, split_k, out = k_slices(x, n, split_k or auto_split(n, k, block_n, block_k), block_k)
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
