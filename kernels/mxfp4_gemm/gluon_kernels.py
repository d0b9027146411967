"""The Gluon kernels (Triton's explicit-layout dialect) behind `gluon.few_rows_matmul`, MXFP4 weights times 1-16 rows
of bf16 activations on the tensor cores, and the layouts they are written in.

Why Gluon: in Triton the layouts are the compiler's, and a decoded weight tile reaches the MMA through shared
memory; here the packed weights are loaded as int32 words straight into a layout whose registers, once each word is
widened to eight bf16 codes, are the MMA's left operand (`word_layout`), so nothing passes through shared memory.

- Each word (eight codes, four bytes) is decoded by inline PTX into four bf16 pairs, E2M1 times 2^-126 by bit
  placement and then times 2^126 (`DECODE`); the group's E8M0 scale multiplies afterwards as bf16 (exact: powers of
  two; 0 is the subnormal 2^-127, 255 NaN). When every scale byte is at most 128 (`gluon.foldable`: blocks up to 12
  in magnitude, i.e. any ordinary weight) the two multiplies are one, by 2^(e-1) (`DECODE_SCALED`), still exact.
- On Hopper the words come by TMA through a two-slot shared-memory ring (`few_rows_tma_kernel`, 64 rows of W on
  two warps); elsewhere straight from global memory into registers (`few_rows_kernel`). Both with the fold: 3-15 %
  faster on the H200 than registers without it.
- The low codes of the words (the even K positions) form one MMA operand and the high codes (odd K) another; x is
  read as int32 pairs (even, odd) and split the same way, so no permutation is needed.
- One K step ahead of the decode and MMAs, the next step's scales and x pairs (and words, without the ring) are
  loaded into registers.
- K slices add into a float32 workspace kept at zero and the slice that arrives last writes the bf16 result and
  clears its part (`h3gen.kernels._arrivals`), so there is no zero fill or cast kernel.

Gluon kernels cannot run under the Triton interpreter: tests check them on a GPU, and replay the decode's bit
arithmetic in torch integers on the CPU."""

import functools

from h3gen.kernels.mxfp4_gemm.ptx import PLACE_CODES, WIDEN_CODES

try:  # Gluon ships with Triton 3.4+ as an experimental module; without it this path is off.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed in Triton 3.7
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False
try:  # Hopper's bulk copies (TMA) and the barriers they complete on
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_TMA = AVAILABLE
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    HAS_TMA = False

# Four bytes (eight codes) in $4 -> $0 $1: the low codes of bytes (0, 1) and (2, 3) as bf16 pairs (element order
# low half first), $2 $3: their high codes (`ptx.WIDEN_CODES`).
DECODE = (
    "{"
    + WIDEN_CODES
    + """mov.b32 $0, a;
mov.b32 $1, b;
mov.b32 $2, c;
mov.b32 $3, d;
}
"""
)

# As DECODE, with the group scale folded in: $5 holds the bf16 pair (2^(e-1), 2^(e-1)) for the word's E8M0 byte e,
# so one multiply gives E2M1 * 2^-126 * 2^(e-1) = E2M1 * 2^(e-127), exact in bf16 while e <= 128 (`foldable`).
DECODE_SCALED = (
    "{"
    + PLACE_CODES
    + """mul.rn.bf16x2 $0, a, $5;
mul.rn.bf16x2 $1, b, $5;
mul.rn.bf16x2 $2, c, $5;
mul.rn.bf16x2 $3, d, $5;
}
"""
)


if AVAILABLE:
    _DECODE = gl.constexpr(DECODE)
    _DECODE_SCALED = gl.constexpr(DECODE_SCALED)

    @gluon.constexpr_function
    def word_layout(block_n, block_k, warps):
        """The int32 layout of a `[block_n, block_k / 8]` word tile whose registers, each word widened to eight
        codes and split into low and high codes, are `DotOperandLayout(0, mma v2, k_width=8)` over
        `[block_n, block_k / 2]`: that layout's bases (registers: 8 consecutive K, then row + 8, then K and row
        repeats; lanes: K by 8 and 16, rows 1, 2, 4; warps: rows by 16) with K counted in words and the two
        byte-in-word register bases dropped."""
        registers = [[0, 1], [8, 0]]
        k = 8
        while k < block_k // 8:
            registers.append([0, k])
            k *= 2
        warp_bases = []
        n, w = 16, 1
        while w < warps:
            warp_bases.append([n, 0])
            n, w = n * 2, w * 2
        while n < block_n:
            registers.append([n, 0])
            n *= 2
        return gl.DistributedLinearLayout(
            reg_bases=registers,
            lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=warp_bases,
            block_bases=[],
            shape=[block_n, block_k // 8],
        )

    @gluon.constexpr_function
    def mma_layout(warps):
        """The accumulator layout: mma v2 (m16n8), warps stacked along the rows of W."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def x_layout(warps):
        """x's pairs `[BK/2, MN]` as the MMA's right operand (k_width 8: eight consecutive K per thread)."""
        return gl.DotOperandLayout(operand_index=1, parent=mma_layout(warps), k_width=8)

    @gluon.jit
    def _pairs_to_bf16(o0, o1, BN: gl.constexpr, BK: gl.constexpr):
        """Two int32 tensors of bf16 pairs `[BN, BK/8]` (o0: elements 4w, 4w+1; o1: 4w+2, 4w+3) -> bf16
        `[BN, BK/2]` (each pair stays in its register)."""
        p0 = gl.join(
            o0.to(gl.int16).to(gl.bfloat16, bitcast=True), (o0 >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        )
        p1 = gl.join(
            o1.to(gl.int16).to(gl.bfloat16, bitcast=True), (o1 >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        )
        return gl.reshape(gl.permute(gl.join(p0, p1), [0, 1, 3, 2]), [BN, BK // 2])

    @gluon.jit
    def _step(words, scale_bytes, pairs, acc, BN: gl.constexpr, BK: gl.constexpr, a_l: gl.constexpr):
        """One K step: decode `words` `[BN, BK/8]` int32, scale by `scale_bytes` `[BN, BK/32]`, and add
        w_low @ x_even + w_high @ x_odd into `acc` `[BN, MN]` float32 (`pairs` `[BK/2, MN]` int32 = x's
        (even, odd) bf16 pairs, transposed)."""
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _DECODE, "=r,=r,=r,=r,r", [words], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1
        )
        low = gl.reshape(_pairs_to_bf16(o0, o1, BN, BK), [BN, BK // 32, 16])
        high = gl.reshape(_pairs_to_bf16(o2, o3, BN, BK), [BN, BK // 32, 16])
        sb = gl.convert_layout(scale_bytes, gl.SliceLayout(2, low.type.layout), assert_trivial=True).to(gl.int16)
        scale = gl.where(sb == 0, 0x0040, gl.where(sb == 255, 0x7FC0, sb << 7)).to(gl.bfloat16, bitcast=True)
        scale = gl.expand_dims(scale, 2)
        a_low = gl.convert_layout(gl.reshape(low * scale, [BN, BK // 2]), a_l, assert_trivial=True)
        a_high = gl.convert_layout(gl.reshape(high * scale, [BN, BK // 2]), a_l, assert_trivial=True)
        x_even = pairs.to(gl.int16).to(gl.bfloat16, bitcast=True)
        x_odd = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        acc = mma_v2(a_low, x_even, acc)
        return mma_v2(a_high, x_odd, acc)

    @gluon.jit
    def _scale_tile(BN: gl.constexpr, BK: gl.constexpr, w_l: gl.constexpr, a_l: gl.constexpr, FOLD: gl.constexpr):
        """A `[BN, BK/32]` tile in the layout the E8M0 bytes are loaded in (only its layout is used): one byte per
        four-word group of `word_layout` when the scales fold into the decode, else per 16-code group of the MMA
        operand."""
        if FOLD:
            words = gl.reshape(gl.full([BN, BK // 8], 0, gl.int32, layout=w_l), [BN, BK // 32, 4])
            return gl.full([BN, BK // 32], 0, gl.int32, layout=gl.SliceLayout(2, words.type.layout))
        else:
            groups = gl.reshape(gl.full([BN, BK // 2], 0, gl.bfloat16, layout=a_l), [BN, BK // 32, 16])
            return gl.full([BN, BK // 32], 0, gl.int32, layout=gl.SliceLayout(2, groups.type.layout))

    @gluon.jit
    def _step_folded(words, scale_bytes, pairs, acc, BN: gl.constexpr, BK: gl.constexpr, a_l: gl.constexpr):
        """As `_step`, for scales that fold (`foldable`): each word's four bf16 pairs come out of the decode
        already scaled (`DECODE_SCALED`); `scale_bytes` `[BN, BK/32]` in `_scale_tile`'s folded layout."""
        e = scale_bytes.to(gl.int32)
        pair = gl.where(e == 255, 0x7FC07FC0, e * 0x00800080 + 0x3F003F00)  # ((e + 126) << 7) in both halves
        words3, pair3 = gl.broadcast(gl.reshape(words, [BN, BK // 32, 4]), gl.expand_dims(pair, 2))
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _DECODE_SCALED,
            "=r,=r,=r,=r,r,r",
            [words3, pair3],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )
        a_low = gl.convert_layout(
            _pairs_to_bf16(gl.reshape(o0, [BN, BK // 8]), gl.reshape(o1, [BN, BK // 8]), BN, BK),
            a_l,
            assert_trivial=True,
        )
        a_high = gl.convert_layout(
            _pairs_to_bf16(gl.reshape(o2, [BN, BK // 8]), gl.reshape(o3, [BN, BK // 8]), BN, BK),
            a_l,
            assert_trivial=True,
        )
        x_even = pairs.to(gl.int16).to(gl.bfloat16, bitcast=True)
        x_odd = (pairs >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        acc = mma_v2(a_low, x_even, acc)
        return mma_v2(a_high, x_odd, acc)

    @gluon.jit
    def _program_slice(k_per_split, BK: gl.constexpr):
        """The program's row tile (axis 0), the first K of its slice (axis 1) and the first K of the slice's last
        step."""
        k_start = gl.program_id(1) * k_per_split
        return gl.program_id(0), k_start, k_start + k_per_split - BK

    @gluon.jit
    def _finish(
        acc, ws_ptr, count_ptr, out_ptr, pid_n, N, M, splits, BN: gl.constexpr, MN: gl.constexpr, mma: gl.constexpr
    ):
        """Write the program's `acc` `[BN, MN]` float32 as out^T rows, or add it into the workspace, the K slice
        that arrives last writing the sum and clearing its part (`h3gen.kernels._arrivals`)."""
        out_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        out_cols = gl.arange(0, MN, layout=gl.SliceLayout(0, mma))
        tile = out_cols[None, :] * N + out_rows[:, None]
        ok = (out_cols[None, :] < M) & (out_rows[:, None] < N)
        if splits == 1:
            gl.store(out_ptr + tile, acc.to(gl.bfloat16), mask=ok)
        else:
            gl.atomic_add(ws_ptr + tile, acc, mask=ok, sem="relaxed")
            _barrier()  # every thread's additions come before the count, which its atomic releases
            if gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == splits - 1:
                total = gl.load(ws_ptr + tile, mask=ok, cache_modifier=".cg")
                gl.store(out_ptr + tile, total.to(gl.bfloat16), mask=ok)
                gl.store(ws_ptr + tile, gl.zeros([BN, MN], gl.float32, layout=mma), mask=ok)
                gl.store(count_ptr + pid_n, 0)

    @gluon.jit
    def few_rows_kernel(
        w32_ptr,
        s_ptr,
        x32_ptr,
        ws_ptr,
        count_ptr,
        out_ptr,
        N,
        M,
        k_per_split,
        splits,
        stride_w32,
        stride_s,
        stride_x32,
        BN: gl.constexpr,
        BK: gl.constexpr,
        MN: gl.constexpr,
        WARPS: gl.constexpr,
        FOLD: gl.constexpr,
    ):
        """out `[M, N]` bf16 = x `[M, K]` @ dequantized W `[N, K]`^T for the program's rows of W (axis 0) and K
        slice (axis 1). `w32_ptr`: the packed codes as int32 words `[N, K/8]`; `s_ptr`: E8M0 bytes `[N, K/32]`;
        `x32_ptr`: x as int32 pairs `[M, K/2]`; `ws_ptr`/`count_ptr`: float32 zeros `[M, N]` and int32 zeros
        (one per row tile) when `splits` > 1. `FOLD`: the scales fold into the decode (`foldable`)."""
        mma: gl.constexpr = mma_layout(WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        w_l: gl.constexpr = word_layout(BN, BK, WARPS)
        s_l: gl.constexpr = _scale_tile(BN, BK, w_l, a_l, FOLD).type.layout
        pid_n, k_start, k_last = _program_slice(k_per_split, BK)
        rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
        w_at = w32_ptr + rows[:, None] * stride_w32 + gl.arange(0, BK // 8, layout=gl.SliceLayout(0, w_l))[None, :]
        w_ok = rows[:, None] < N
        s_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        s_at = s_ptr + s_rows[:, None] * stride_s + gl.arange(0, BK // 32, layout=gl.SliceLayout(0, s_l))[None, :]
        s_ok = s_rows[:, None] < N
        x_cols = gl.arange(0, MN, layout=gl.SliceLayout(0, x_layout(WARPS)))
        x_at = (
            x32_ptr
            + x_cols[None, :] * stride_x32
            + gl.arange(0, BK // 2, layout=gl.SliceLayout(1, x_layout(WARPS)))[:, None]
        )
        x_ok = x_cols[None, :] < M
        acc = gl.zeros([BN, MN], gl.float32, layout=mma)
        words = gl.load(w_at + gl.multiple_of(k_start // 8, 16), mask=w_ok, other=0)
        scale_bytes = gl.load(s_at + gl.multiple_of(k_start // 32, 4), mask=s_ok, other=127)
        pairs = gl.load(x_at + gl.multiple_of(k_start // 2, 64), mask=x_ok, other=0)
        for k0 in range(k_start, k_start + k_per_split, BK):
            ahead = gl.minimum(k0 + BK, k_last)  # the last step re-reads its own (cached) tile instead of branching
            next_words = gl.load(w_at + gl.multiple_of(ahead // 8, 16), mask=w_ok, other=0)
            next_scales = gl.load(s_at + gl.multiple_of(ahead // 32, 4), mask=s_ok, other=127)
            next_pairs = gl.load(x_at + gl.multiple_of(ahead // 2, 64), mask=x_ok, other=0)
            if FOLD:
                acc = _step_folded(words, scale_bytes, pairs, acc, BN, BK, a_l)
            else:
                acc = _step(words, scale_bytes, pairs, acc, BN, BK, a_l)
            words = next_words
            scale_bytes = next_scales
            pairs = next_pairs
        _finish(acc, ws_ptr, count_ptr, out_ptr, pid_n, N, M, splits, BN, MN, mma)


if HAS_TMA:

    @gluon.jit
    def _ring_step(
        i,
        acc,
        scale_bytes,
        pairs,
        ring,
        arrived,
        w_desc,
        s_at,
        x_at,
        pid_n,
        k_start,
        k_last,
        steps,
        BN: gl.constexpr,
        BK: gl.constexpr,
        STAGES: gl.constexpr,
        FOLD: gl.constexpr,
        w_l: gl.constexpr,
        a_l: gl.constexpr,
    ):
        """Step `i` of `few_rows_tma_kernel`: load the next step's scales and x pairs, wait for this step's words,
        take them from the ring, refill the slot with step `i + STAGES`, decode and multiply. Returns the new
        accumulator and the next step's scales and pairs."""
        ahead = gl.minimum(k_start + (i + 1) * BK, k_last)
        next_scales = gl.load(s_at + gl.multiple_of(ahead // 32, 4))
        next_pairs = gl.load(x_at + gl.multiple_of(ahead // 2, 64))
        slot = i % STAGES
        mbarrier.wait(arrived.index(slot), (i // STAGES) & 1)
        words = ring.index(slot).load(w_l)
        _barrier()  # every warp holds this step's words: the slot can take the step STAGES ahead
        refill = i + STAGES < steps
        mbarrier.expect(arrived.index(slot), BN * BK // 2, pred=refill)
        tma.async_copy_global_to_shared(
            w_desc, [pid_n * BN, (k_start + (i + STAGES) * BK) // 8], arrived.index(slot), ring.index(slot), pred=refill
        )
        if FOLD:
            acc = _step_folded(words, scale_bytes, pairs, acc, BN, BK, a_l)
        else:
            acc = _step(words, scale_bytes, pairs, acc, BN, BK, a_l)
        return acc, next_scales, next_pairs

    @gluon.jit
    def few_rows_tma_kernel(
        w_desc,
        s_ptr,
        x32_ptr,
        ws_ptr,
        count_ptr,
        out_ptr,
        N,
        M,
        k_per_split,
        splits,
        stride_s,
        stride_x32,
        BN: gl.constexpr,
        BK: gl.constexpr,
        MN: gl.constexpr,
        WARPS: gl.constexpr,
        STAGES: gl.constexpr,
        FOLD: gl.constexpr,
    ):
        """`few_rows_kernel` for Hopper: the weight words `[BN, BK/8]` of each K step arrive by TMA (`w_desc`,
        over the int32 words `[N, K/8]`, rows past N read as zeros) in a ring of `STAGES` shared-memory slots;
        each warp loads its words from the slot in `word_layout`, and once every warp has, the slot is refilled
        with the step `STAGES` ahead. Scales and x are loaded one step ahead into registers as there."""
        mma: gl.constexpr = mma_layout(WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        w_l: gl.constexpr = word_layout(BN, BK, WARPS)
        s_l: gl.constexpr = _scale_tile(BN, BK, w_l, a_l, FOLD).type.layout
        pid_n, k_start, k_last = _program_slice(k_per_split, BK)
        steps = k_per_split // BK
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], w_desc.layout)
        arrived = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(arrived.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.expect(arrived.index(i), BN * BK // 2, pred=i < steps)
            tma.async_copy_global_to_shared(
                w_desc, [pid_n * BN, (k_start + i * BK) // 8], arrived.index(i), ring.index(i), pred=i < steps
            )
        # rows of W past N and columns of x past M read the last real one instead of being masked (no zeroing or
        # predicates per step); the results they feed are not stored
        s_rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, s_l)), N - 1)
        s_at = s_ptr + s_rows[:, None] * stride_s + gl.arange(0, BK // 32, layout=gl.SliceLayout(0, s_l))[None, :]
        x_cols = gl.minimum(gl.arange(0, MN, layout=gl.SliceLayout(0, x_layout(WARPS))), M - 1)
        x_at = (
            x32_ptr
            + x_cols[None, :] * stride_x32
            + gl.arange(0, BK // 2, layout=gl.SliceLayout(1, x_layout(WARPS)))[:, None]
        )
        acc = gl.zeros([BN, MN], gl.float32, layout=mma)
        scale_bytes = gl.load(s_at + gl.multiple_of(k_start // 32, 4))
        pairs = gl.load(x_at + gl.multiple_of(k_start // 2, 64))
        for i in range(steps):
            acc, scale_bytes, pairs = _ring_step(
                i,
                acc,
                scale_bytes,
                pairs,
                ring,
                arrived,
                w_desc,
                s_at,
                x_at,
                pid_n,
                k_start,
                k_last,
                steps,
                BN,
                BK,
                STAGES,
                FOLD,
                w_l,
                a_l,
            )
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(arrived.index(i))
        _finish(acc, ws_ptr, count_ptr, out_ptr, pid_n, N, M, splits, BN, MN, mma)


def ring_descriptor(words, block_rows: int, block_words: int) -> "TensorDescriptor":
    """The TMA descriptor `few_rows_tma_kernel` reads the weight words through: int32 `words` `[N, K/8]` in
    `[block_rows, block_words]` boxes, laid out in shared memory as a ring slot (`_ring_layout`)."""
    return TensorDescriptor(words, list(words.shape), list(words.stride()), [block_rows, block_words], _ring_layout())


@functools.cache
def _ring_layout():
    """Shared-memory layout of a ring slot `[rows, 16]` int32: rows of 64 bytes with the 64-byte swizzle, which
    spreads `word_layout`'s 8-byte reads over all banks."""
    return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)
