"""The MXFP4-expert twins of the dense decode expert kernels in Triton (`expert_gemv_mxfp4`,
`expert_swiglu_down_mxfp4`): E2M1 weights decoded from 32-bit words in registers (see `mxfp4_gemm.triton_gemv`)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs
from h3gen.kernels.mxfp4_gemm.triton_gemv import word_rows, word_rows_dot, word_x


@triton.jit
def _expert_gemv_mxfp4_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    ids_ptr,
    out_ptr,
    N,
    K,
    top_k,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    PDL: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)  # a (token, slot) pair; its input is the token's row
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    wait_for_inputs(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    packed = packed_ptr + expert * stride_pe
    scales = scale_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
    for k0 in range(0, K, 8 * WORDS):
        x8 = word_x(x_ptr + (pair // top_k) * K, k0, K, WORDS)
        acc += word_rows_dot(packed, scales, offs_n, n_ok, k0, K, stride_pn, stride_sn, x8, WORDS)
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + pair * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _mxfp4_tail_step(
    both_ptr, packed, scales, pair, offs_n, n_ok, k0, stride_pn, stride_sn, INTER: tl.constexpr, WORDS: tl.constexpr
):
    """One K step of one slot of the MXFP4 decode tail: SwiGLU of the pair's activations times its down expert's
    rows -> `(BLOCK_N, WORDS / 4)` float32 group sums."""
    ks = k0 + tl.arange(0, WORDS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    up = tl.load(both_ptr + pair * 2 * INTER + ks, mask=ks < INTER, other=0.0).to(tl.float32)
    gate = tl.load(both_ptr + pair * 2 * INTER + INTER + ks, mask=ks < INTER, other=0.0).to(tl.float32)
    # rounded as the separate SwiGLU kernel's output would be, then carrying 2^64 (see WORD_X_SCALE)
    act = (up * gate * tl.sigmoid(gate)).to(both_ptr.dtype.element_ty).to(tl.float32)
    return word_rows_dot(
        packed, scales, offs_n, n_ok, k0, INTER, stride_pn, stride_sn, act * 18446744073709551616.0, WORDS
    )


@triton.jit
def _expert_swiglu_down_mxfp4_kernel(
    both_ptr,
    packed_ptr,
    scale_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    N,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """With `UNROLL` the slots and K steps are straight-line code, so all slots' word loads are in flight together
    (a few tokens: few programs, each must keep many bytes in flight); without, a loop over slots (many tokens)."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    wait_for_inputs(PDL)
    if UNROLL:
        for slot in tl.static_range(TOP_K):
            pair = token * TOP_K + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
            for step in tl.static_range(0, INTER, 8 * WORDS):
                acc += _mxfp4_tail_step(
                    both_ptr,
                    packed_ptr + expert * stride_pe,
                    scale_ptr + expert * stride_se,
                    pair,
                    offs_n,
                    n_ok,
                    tl.full((), step, tl.int32),
                    stride_pn,
                    stride_sn,
                    INTER,
                    WORDS,
                )
            total += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(acc, axis=1)
    else:
        for slot in range(0, TOP_K):
            pair = token * TOP_K + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
            for k0 in range(0, INTER, 8 * WORDS):
                acc += _mxfp4_tail_step(
                    both_ptr,
                    packed_ptr + expert * stride_pe,
                    scale_ptr + expert * stride_se,
                    pair,
                    offs_n,
                    n_ok,
                    k0,
                    stride_pn,
                    stride_sn,
                    INTER,
                    WORDS,
                )
            total += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(acc, axis=1)
    tl.store(out_ptr + token * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _word_tiles(k: int, block_n: int, block_k: int | None) -> tuple[int, int]:
    """Rows and K elements per step of the word-decoding expert kernels: `block_k` a multiple of 32, at most the
    padded K."""
    block_k = block_k or 512
    block_k = min(block_k, max(32, next_power_of_2(k)))
    if block_k % 32:
        raise ValueError(f"block_k {block_k} is not a multiple of 32 (one MXFP4 scale group).")
    return block_n, block_k


def expert_gemv_mxfp4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    ids: torch.Tensor,
    top_k: int = 1,
    block_n: int = 16,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """See `reference.expert_gemv_mxfp4`: pair p (row `p // top_k` of `x`) through its expert, decoded from the packed
    words inside the kernel (`word_rows_dot`). Default tiles from the H200 sweep (64 experts, 2048 -> 1536, top 6): 16
    rows x 512 K per program, 4 warps for one token's pairs (7.4 us), 2 for more (38.4 us at 8 tokens)."""
    x = x.contiguous()
    packed = word_rows(packed)
    k, n, pairs = x.shape[1], packed.shape[1], ids.numel()
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    block_n, block_k = _word_tiles(k, block_n, block_k)
    num_warps = num_warps or (4 if pairs <= 12 else 2)
    pdl = pdl_launch(x)
    _expert_gemv_mxfp4_kernel[(pairs, triton.cdiv(n, block_n))](
        x,
        packed,
        scales,
        ids.contiguous(),
        out,
        n,
        k,
        top_k,
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        BLOCK_N=block_n,
        WORDS=block_k // 8,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )
    return out


# Up to this many tokens the MXFP4 decode tail unrolls its slots (measured better at 1, 2 and 8, worse at 32), as
# long as slots x K steps stay within MXFP4_TAIL_UNROLL_BODIES (code size and compile time grow with them).
MXFP4_TAIL_UNROLL_TOKENS = 8
MXFP4_TAIL_UNROLL_BODIES = 24  # the measured mid config unrolls 6 slots x 3 steps at 3-8 tokens


def expert_swiglu_down_mxfp4(
    both: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """See `reference.expert_swiglu_down_mxfp4`: SwiGLU, each pair's MXFP4 down expert and the weighted slot sum in one
    kernel (one program per token and block of outputs). Defaults from the H200 sweep (64 experts, 768 -> 2048, top 6):
    up to `MXFP4_TAIL_UNROLL_TOKENS` tokens the slots unrolled, 4 warps, 8 x 1024 for one token (7.8 us; the slot loop:
    11.5), 16 x 1024 for two (10.7; 16.2), 32 x 256 beyond (27.0 at 8; 29.7); more tokens loop over the slots, 32 x 256
    with 2 warps (79.7 us at 32; unrolled: 97.8)."""
    both = both.contiguous()
    packed = word_rows(packed)
    tokens, top_k = ids.shape
    n, inter = packed.shape[1], both.shape[1] // 2
    out = torch.empty(tokens, n, dtype=both.dtype, device=both.device)
    if tokens == 0:
        return out
    few = tokens <= 2
    block_n, block_k = _word_tiles(inter, block_n or (8 * tokens if few else 32), block_k or (1024 if few else 256))
    unroll = tokens <= MXFP4_TAIL_UNROLL_TOKENS and top_k * triton.cdiv(inter, block_k) <= MXFP4_TAIL_UNROLL_BODIES
    pdl = pdl_launch(both)
    _expert_swiglu_down_mxfp4_kernel[(tokens, triton.cdiv(n, block_n))](
        both,
        packed,
        scales,
        ids.contiguous(),
        weights.contiguous(),
        out,
        n,
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        TOP_K=top_k,
        INTER=inter,
        BLOCK_N=block_n,
        WORDS=block_k // 8,
        UNROLL=unroll,
        PDL=pdl_flag(pdl),
        num_warps=num_warps or (4 if unroll else 2),
        **pdl,
    )
    return out
