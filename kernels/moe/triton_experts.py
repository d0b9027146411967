"""The dense expert kernels in Triton: `expert_gemv` (one program per (token, slot) pair and block of outputs
reads its expert's rows straight from the stacked weights, so a decode step reads each chosen expert's bytes once
per row), `expert_swiglu_down` (SwiGLU, the down experts and the weighted slot sum in one kernel), and for prefill
the grouped GEMM over pairs grouped by expert (`moe_blocks`, `grouped_expert_gemm`)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _expert_gemv_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    N,
    K,
    top_k,
    first_always,
    stride_we,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALWAYS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (token, slot) pair and block of N outputs per program. The last `ALWAYS` slots of each token hold the
    always-on experts `first_always`, `first_always + 1`, ...: their programs know their expert without the
    routing, so their first K step's weights load while the kernel before drains (the routed ones wait for it)."""
    row = tl.program_id(0).to(tl.int64)  # a (token, slot) pair; its input is the token's row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    slot = row % top_k
    known = False
    if ALWAYS > 0:
        known = slot >= top_k - ALWAYS
    if known:
        expert = (first_always + slot - (top_k - ALWAYS)).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        wait_for_inputs(PDL)
    else:
        wait_for_inputs(PDL)  # the ids come from the kernel just before
        expert = tl.load(ids_ptr + row).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    x = tl.load(x_ptr + (row // top_k) * K + ks, mask=ks < K, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (row // top_k) * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        tile = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)
        acc += tl.sum(tile.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _swiglu_down_step(both_ptr, pairs, slot_ok, ks, inter, w):
    """One K step of the decode tail: SwiGLU of the slots' activations at `ks` times their weight tile `w`
    `(SLOTS, BLOCK_N, BLOCK_K)` -> `(SLOTS, BLOCK_N)` float32."""
    act_ptrs = both_ptr + pairs[:, None] * 2 * inter + ks[None, :]
    act_ok = slot_ok[:, None] & (ks < inter)[None, :]
    up = tl.load(act_ptrs, mask=act_ok, other=0.0).to(tl.float32)
    gate = tl.load(act_ptrs + inter, mask=act_ok, other=0.0).to(tl.float32)
    # rounded as the separate SwiGLU kernel's output would be
    act = (up * gate * tl.sigmoid(gate)).to(both_ptr.dtype.element_ty).to(tl.float32)
    return tl.sum(w.to(tl.float32) * act[:, None, :], axis=2)


@triton.jit
def _expert_swiglu_down_kernel(
    both_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    add_ptr,
    out_ptr,
    N,
    inter,
    top_k,
    stride_we,
    stride_wn,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    AHEAD: tl.constexpr,
    ADD: tl.constexpr,
):
    """All k slots of one token at once (`SLOTS` >= top_k, a power of two): the slots' weight tiles are independent
    loads, so a program has k times the bytes in flight that a loop over slots would. With `AHEAD` > 0 (up to 4,
    and PDL) the routing (written two kernels back) and the first `AHEAD` K steps' weights load while the gate/up
    kernel drains, all before any is used; that holds more registers, so it is for a token or two (few programs),
    not for larger batches."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS)
    slot_ok = slots < top_k
    pairs = token * top_k + slots
    experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    rows = w_ptr + experts[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
    row_ok = slot_ok[:, None, None] & (cols < N)[None, :, None]
    # The slots' routing weights come with their ids (read before the wait with AHEAD): loaded here, not after the
    # last K step, where they cost one more round trip at the end of every program.
    slot_weight = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0).to(tl.float32)
    if AHEAD == 0:
        wait_for_inputs(PDL)
        acc = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    else:
        ks0 = tl.arange(0, BLOCK_K)
        w0 = tl.load(rows + ks0[None, None, :], mask=row_ok & (ks0 < inter)[None, None, :], other=0.0)
        if AHEAD > 1:
            ks1 = BLOCK_K + tl.arange(0, BLOCK_K)
            w1 = tl.load(rows + ks1[None, None, :], mask=row_ok & (ks1 < inter)[None, None, :], other=0.0)
        if AHEAD > 2:
            ks2 = 2 * BLOCK_K + tl.arange(0, BLOCK_K)
            w2 = tl.load(rows + ks2[None, None, :], mask=row_ok & (ks2 < inter)[None, None, :], other=0.0)
        if AHEAD > 3:
            ks3 = 3 * BLOCK_K + tl.arange(0, BLOCK_K)
            w3 = tl.load(rows + ks3[None, None, :], mask=row_ok & (ks3 < inter)[None, None, :], other=0.0)
        wait_for_inputs(PDL)
        acc = _swiglu_down_step(both_ptr, pairs, slot_ok, ks0, inter, w0)
        if AHEAD > 1:
            acc += _swiglu_down_step(both_ptr, pairs, slot_ok, ks1, inter, w1)
        if AHEAD > 2:
            acc += _swiglu_down_step(both_ptr, pairs, slot_ok, ks2, inter, w2)
        if AHEAD > 3:
            acc += _swiglu_down_step(both_ptr, pairs, slot_ok, ks3, inter, w3)
    for start in range(AHEAD * BLOCK_K, inter, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(rows + ks[None, None, :], mask=row_ok & (ks < inter)[None, None, :], other=0.0)
        acc += _swiglu_down_step(both_ptr, pairs, slot_ok, ks, inter, w)
    total = tl.sum(acc * slot_weight[:, None], axis=0)
    if ADD:  # written by the kernel just before: read after the wait
        total += tl.load(add_ptr + token * N + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


def _gemv_tiles(
    k: int, pairs: int, block_n: int | None, block_k: int | None, num_warps: int | None
) -> tuple[int, int, int]:
    """Default tiles and warps of the expert GEMVs: the whole K (up to 2048) in one step; for up to 16 (token, expert)
    pairs (decode at one or two tokens) 4 K of weights per program and 2 warps, else 8 K and 4 warps (H200 sweeps: in a
    graphed chain of 15 MoE layers, 2 x 2048 with 2 warps took 25.4 us per layer at one token against 27.9 for 4 x 2048
    with 4; 4 x 2048 and 8 x 1024 were the fastest at 6 to 48 pairs)."""
    block_k = block_k or min(2048, max(16, next_power_of_2(k)))
    few = pairs <= 16
    return block_n or max(2 if few else 4, (4096 if few else 8192) // block_k), block_k, num_warps or (2 if few else 4)


def expert_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    top_k: int = 1,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    always: int = 0,
    early: bool | None = None,
) -> torch.Tensor:
    """See `reference.expert_gemv`: `x` `[P / top_k, K]`, `weight` `[E, N, K]` (inner axis contiguous), `ids` `[P]`.
    `always`: the last that many of each token's `top_k` slots are the always-on experts E - always, ..., E - 1 (stacked
    after the routed ones, as `route_topk(..., always=)` routes them); with `early` their weights load before the
    routing is known. Default: early above 16 pairs (H200: b=8 decode 2.414 -> 2.301 ms per step; at one or two tokens
    the MoE layer lost 1.2 us, and so did running the always-on pairs as a kernel of their own, 3 us)."""
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    x = x.contiguous()
    k, n, pairs = x.shape[1], weight.shape[1], ids.numel()
    if not 0 <= always <= top_k:
        raise ValueError(f"expert_gemv's always-on slots must be between 0 and top_k = {top_k} (got {always}).")
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    block_n, block_k, num_warps = _gemv_tiles(k, pairs, block_n, block_k, num_warps)
    if early is None:
        early = pairs > 16
    pdl = pdl_launch(x)
    _expert_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        x,
        weight,
        ids.contiguous(),
        out,
        n,
        k,
        top_k,
        weight.shape[0] - always,
        weight.stride(0),
        weight.stride(1),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ALWAYS=always if early else 0,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )
    return out


def expert_swiglu_down(
    both: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    block_n: int = 8,
    block_k: int | None = None,
    num_warps: int | None = None,
    ahead: int | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `reference.expert_swiglu_down`: SwiGLU, the down GEMV and the weighted sum over the k slots in one kernel
    (one program per token and block of outputs, all slots at once). Default tile from the H200 sweeps (64 experts, 2048
    x 768, top 6 + the shared expert): K steps narrow as top-k grows (256 at 5-8 slots) so the tile of all slots stays
    in registers; 8 warps at one token (26.3 against 27.9 us per MoE layer in a graphed 15-layer chain), K steps halved
    at two (35.2 against 39.6). `ahead` (0 to 4; default 1 for up to two tokens, else 0): K steps whose weights load
    before the PDL wait (2 to 4 were no faster on the H200 at one or two tokens). `add` `[T, W]`: added to the sum
    before its rounding."""
    if down.stride(-1) != 1:
        down = down.contiguous()
    both = both.contiguous()
    tokens, top_k = ids.shape
    n, inter = down.shape[1], down.shape[2]
    if ahead is not None and not 0 <= ahead <= 4:
        raise ValueError(f"expert_swiglu_down loads 0 to 4 K steps ahead (got {ahead}).")
    out = torch.empty(tokens, n, dtype=both.dtype, device=both.device)
    if tokens == 0:
        return out
    block_k = block_k or max(32, 2048 // next_power_of_2(top_k) // (2 if tokens == 2 else 1))
    pdl = pdl_launch(both)
    _expert_swiglu_down_kernel[(tokens, triton.cdiv(n, block_n))](
        both,
        down,
        ids.contiguous(),
        weights.contiguous(),
        add.contiguous() if add is not None else out,
        out,
        n,
        inter,
        top_k,
        down.stride(0),
        down.stride(1),
        SLOTS=next_power_of_2(top_k),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl_flag(pdl),
        AHEAD=(1 if tokens <= 2 else 0) if ahead is None else ahead,
        ADD=add is not None,
        num_warps=num_warps or (8 if tokens == 1 else 4),
        **pdl,
    )
    return out


def moe_blocks(pairs: torch.Tensor, num_experts: int, block_m: int):
    """Group `pairs` (`[P]` expert id of each (token, slot) pair) into blocks of `block_m` rows of one expert, on the
    device (no host synchronisation). Returns (`rows` `[max_blocks * block_m]` pair indices, -1 where a block is
    padding; `block_expert` `[max_blocks]`, -1 for unused blocks); max_blocks = cdiv(P, block_m) + E bounds
    the real count."""
    count = pairs.numel()
    device = pairs.device
    order = torch.argsort(pairs, stable=True)
    # Counted by scatter-add, not bincount: bincount reads the largest id back to the host, which a graph cannot.
    per_expert = torch.zeros(num_experts, dtype=torch.long, device=device)
    per_expert.scatter_add_(0, pairs, torch.ones_like(pairs))
    blocks = (per_expert + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    max_blocks = triton.cdiv(count, block_m) + num_experts
    expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    block_expert = torch.where(expert < num_experts, expert, torch.full_like(expert, -1))
    sorted_expert = pairs[order]
    rank = torch.arange(count, device=device) - (torch.cumsum(per_expert, 0) - per_expert)[sorted_expert]
    rows = torch.full((max_blocks * block_m,), -1, dtype=torch.long, device=device)
    rows[(block_end - blocks)[sorted_expert] * block_m + rank] = order
    return rows, block_expert


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    rows_ptr,
    block_expert_ptr,
    out_ptr,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    row_divisor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    IEEE: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    source = tl.where(valid, rows // row_divisor, 0)  # the input row: the token (first GEMM) or the pair itself
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + source[:, None].to(tl.int64) * stride_x + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w_mask = (cols[None, :] < N) & (ks[:, None] < K)
        b = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SWIGLU:  # the gate rows sit N rows below the up rows
            g = tl.load(w_cols + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            if IEEE:
                acc_gate += tl.dot(a, g, input_precision="ieee")
            else:
                acc_gate += tl.dot(a, g)
    if SWIGLU:
        acc = acc * acc_gate * tl.sigmoid(acc_gate)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def grouped_expert_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    row_divisor: int,
    swiglu: bool = False,
    block_m: int = 64,
    block_n: int | None = None,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Pair p (grouped by `moe_blocks`) times its expert's matrix: input row `p // row_divisor` of `x` `[R, K]`,
    `weight` `[E, N_w, K]`. Returns `[num_pairs, N_w]`, or with `swiglu` (`weight` = [up; gate] rows)
    `[num_pairs, N_w / 2]` = up * silu(gate); float32 accumulation, output in x.dtype."""
    x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    n = weight.shape[1] // 2 if swiglu else weight.shape[1]
    k = x.shape[1]
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    block_n = block_n or (64 if swiglu else 128)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x,
        weight,
        rows,
        block_expert,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        row_divisor,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SWIGLU=swiglu,
        IEEE=x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
