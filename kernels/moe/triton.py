"""`expert_gemv` in Triton: one program per (row, block of N outputs) reads its row's expert matrix straight from the
stacked weights (no gathered copy), so a decode step reads each chosen expert's bytes once per row."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._arrivals import arrival_counters
from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs
from h3gen.kernels.mxfp4_gemm.triton import _word_rows_dot, _word_x, word_rows


@triton.jit
def _expert_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, top_k, first_always, stride_we, stride_wn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALWAYS: tl.constexpr, PDL: tl.constexpr):
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
def _expert_swiglu_down_kernel(both_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, N, inter, top_k, stride_we,
                               stride_wn, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               PDL: tl.constexpr, AHEAD: tl.constexpr):
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
    slot_weight = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0).to(tl.float32)
    total = tl.sum(acc * slot_weight[:, None], axis=0)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, E, D, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    w_rows = w_ptr + experts[:, None].to(tl.int64) * D
    ds = tl.arange(0, BLOCK_D)
    w = tl.load(w_rows + ds[None, :], mask=(experts[:, None] < E) & (ds[None, :] < D), other=0.0)
    wait_for_inputs(PDL)  # the first step's weights are in flight while the previous kernel drains
    for start in range(0, D, BLOCK_D):
        ds = start + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + token * D + ds, mask=ds < D, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        ds += BLOCK_D
        w = tl.load(w_rows + ds[None, :], mask=(experts[:, None] < E) & (ds[None, :] < D), other=0.0)
    tl.store(out_ptr + token * E + experts, acc, mask=experts < E)


def _rows_and_output(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` made contiguous and the `[rows, n]` output in its dtype."""
    x = x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)


def _gemv_tiles(k: int, pairs: int, block_n: int | None, block_k: int | None,
                num_warps: int | None) -> tuple[int, int, int]:
    """Default tiles and warps of the expert GEMVs: the whole K (up to 2048) in one step; for up to 16 (token,
    expert) pairs (decode at one or two tokens) 4 K of weights per program and 2 warps, else 8 K and 4 warps (H200
    sweeps in RESULTS.md: in a graphed chain of 15 MoE layers, 2 x 2048 with 2 warps took 25.4 us per layer at
    one token against 27.9 for 4 x 2048 with 4; 4 x 2048 and 8 x 1024 were the fastest at 6 to 48 pairs)."""
    block_k = block_k or min(2048, max(16, next_power_of_2(k)))
    few = pairs <= 16
    return block_n or max(2 if few else 4, (4096 if few else 8192) // block_k), block_k, num_warps or (2 if few else 4)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, top_k: int = 1, block_n: int | None = None,
                block_k: int | None = None, num_warps: int | None = None, always: int = 0,
                early: bool | None = None) -> torch.Tensor:
    """See `reference.expert_gemv`: `x` `[P / top_k, K]`, `weight` `[E, N, K]` (inner axis contiguous), `ids`
    `[P]`. `always`: the last that many of each token's `top_k` slots are the always-on experts E - always, ...,
    E - 1 (stacked after the routed ones, as `route_topk(..., always=)` routes them); with `early` their weights
    load before the routing is known. Default: early above 16 pairs (H200, RESULTS.md ninth session: b=8 decode
    2.414 -> 2.301 ms per step; at one or two tokens the MoE layer lost 1.2 us, and so did running the always-on
    pairs as a kernel of their own, 3 us)."""
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
        x, weight, ids.contiguous(), out, n, k, top_k, weight.shape[0] - always, weight.stride(0), weight.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, ALWAYS=always if early else 0, PDL=pdl_flag(pdl), num_warps=num_warps, **pdl)
    return out


def expert_swiglu_down(both: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       block_n: int = 8, block_k: int | None = None, num_warps: int | None = None,
                       ahead: int | None = None) -> torch.Tensor:
    """See `reference.expert_swiglu_down`: SwiGLU, the down GEMV and the weighted sum over the k slots in one
    kernel (one program per token and block of outputs, all slots at once). Default tile from the H200 sweeps
    (RESULTS.md: 64 experts, 2048 x 768, top 6 + the shared expert): K steps narrow as top-k grows (256 at 5-8
    slots) so the tile of all slots stays in registers; 8 warps at one token (26.3 against 27.9 us per MoE layer
    in a graphed 15-layer chain), K steps halved at two (35.2 against 39.6). `ahead` (0 to 4; default 1 for up to
    two tokens, else 0): K steps whose weights load before the PDL wait (2 to 4 were no faster on the H200
    at one or two tokens, RESULTS.md ninth session)."""
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
        both, down, ids.contiguous(), weights.contiguous(), out, n, inter, top_k, down.stride(0), down.stride(1),
        SLOTS=next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_flag(pdl),
        AHEAD=(1 if tokens <= 2 else 0) if ahead is None else ahead,
        num_warps=num_warps or (8 if tokens == 1 else 4), **pdl)
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor, block_e: int = 1, block_d: int | None = None,
                  num_warps: int = 4) -> torch.Tensor:
    """See `reference.router_logits`: one program per token and `block_e` experts, float32 math on the stored
    dtypes (no cast copies). One expert per program measured best (H200, 64 x 2048: 1.9 us against 6.1 us for
    torch's cast + float32 linear; RESULTS.md)."""
    x, weight = x.contiguous(), weight.contiguous()
    tokens, d = x.shape
    experts = weight.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    block_d = block_d or min(2048, max(16, next_power_of_2(d)))
    pdl = pdl_launch(x)
    _router_logits_kernel[(tokens, triton.cdiv(experts, block_e))](x, weight, out, experts, d, BLOCK_E=block_e,
                                                                     BLOCK_D=block_d, PDL=pdl_flag(pdl),
                                                                     num_warps=num_warps, **pdl)
    return out


@triton.jit
def _route_token(logits_ptr, bias_ptr, weights_ptr, ids_ptr, token, experts, scaling, TOP_K: tl.constexpr,
                 ALWAYS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RENORMALIZE: tl.constexpr):
    """Route `token` from its float32 logits row (read from L2: other programs may have just written it) and store
    its `TOP_K + ALWAYS` weights (float32) and expert ids (int64). Sigmoid scores, the correction bias for the selection only,
    the best first (topk's order), optionally renormalised, times `scaling`; always-on experts E, E + 1, ... after
    them with weight 1."""
    es = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    valid = es < experts
    scores = tl.sigmoid(tl.load(logits_ptr + token * experts + es, mask=valid, other=0.0,
                                cache_modifier=".cg").to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + es, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):  # the best remaining expert, TOP_K times (topk's order: best first)
        best = tl.max(choice, axis=0)
        index = tl.min(tl.where(choice == best, es, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(es == index, scores, 0.0), axis=0)
        chosen_w = tl.where(ks == slot, weight, chosen_w)
        chosen_id = tl.where(ks == slot, index.to(tl.int64), chosen_id)
        choice = tl.where(es == index, float("-inf"), choice)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    routed = ks < TOP_K
    chosen_w = tl.where(routed, chosen_w * scaling, 1.0)
    chosen_id = tl.where(routed, chosen_id, experts + ks - TOP_K)
    keep = ks < TOP_K + ALWAYS
    tl.store(weights_ptr + token * (TOP_K + ALWAYS) + ks, chosen_w, mask=keep)
    tl.store(ids_ptr + token * (TOP_K + ALWAYS) + ks, chosen_id, mask=keep)


@triton.jit
def _route_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, experts, scaling,
                       TOP_K: tl.constexpr, ALWAYS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    wait_for_inputs(PDL)
    _route_token(logits_ptr, bias_ptr, weights_ptr, ids_ptr, token, experts, scaling, TOP_K, ALWAYS, BLOCK_E,
                 BLOCK_K, HAS_BIAS, RENORMALIZE)


@triton.jit
def _router_topk_kernel(x_ptr, delta_ptr, nw_ptr, w_ptr, total_ptr, normed_ptr, logits_ptr, bias_ptr, weights_ptr,
                        ids_ptr, count_ptr, experts, D, eps, scaling, RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
                        TOP_K: tl.constexpr, ALWAYS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, expert): the expert's logit from the whole row (with `RESIDUAL`, the row is the
    residual sum `x + delta` normalised, both rounded as `add_rms_norm` rounds them and stored by expert 0's
    program); the token's last program to arrive routes it from all the logits."""
    token = tl.program_id(0).to(tl.int64)
    expert = tl.program_id(1)
    ds = tl.arange(0, BLOCK_D)
    ok = ds < D
    w = tl.load(w_ptr + expert.to(tl.int64) * D + ds, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        norm_w = tl.load(nw_ptr + ds, mask=ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)  # the router's (and the norm's) weights are in flight while the previous kernel drains
    row = tl.load(x_ptr + token * D + ds, mask=ok, other=0.0)
    if RESIDUAL:
        total = (row.to(tl.float32) + tl.load(delta_ptr + token * D + ds, mask=ok, other=0.0).to(tl.float32)).to(
            x_ptr.dtype.element_ty)
        v = total.to(tl.float32)
        normed = (v * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        row = (norm_w * normed).to(normed_ptr.dtype.element_ty)
        if expert == 0:
            tl.store(total_ptr + token * D + ds, total, mask=ok)
            tl.store(normed_ptr + token * D + ds, row, mask=ok)
    tl.store(logits_ptr + token * experts + expert, tl.sum(w * row.to(tl.float32), axis=0))
    tl.debug_barrier()  # every thread's stores come before the count, which its atomic releases
    if tl.atomic_add(count_ptr + token, 1, sem="acq_rel", scope="gpu") == experts - 1:  # all logits are stored
        _route_token(logits_ptr, bias_ptr, weights_ptr, ids_ptr, token, experts, scaling, TOP_K, ALWAYS, BLOCK_E,
                     BLOCK_K, HAS_BIAS, RENORMALIZE)
        tl.store(count_ptr + token, 0)  # ready for the next launch (and graph replay)


def route_topk(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, renormalize: bool = True,
               scaling: float = 1.0, always: int = 0):
    """`reference.route_topk` without expert groups, one program per token: `logits` `[T, E]` -> (weights
    `[T, top_k + always]` float32, ids `[T, top_k + always]` int64)."""
    logits = logits.float().contiguous()
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k + always, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + always, dtype=torch.long, device=logits.device)
    if tokens:
        pdl = pdl_launch(logits)
        _route_topk_kernel[(tokens,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids, experts, scaling,
            TOP_K=top_k, ALWAYS=always, BLOCK_E=next_power_of_2(experts), BLOCK_K=next_power_of_2(top_k + always),
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, PDL=pdl_flag(pdl),
            num_warps=1 if experts <= 256 else 4, **pdl)
    return weights, ids


def router_topk(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                renormalize: bool = True, scaling: float = 1.0, always: int = 0, residual=None, num_warps: int = 1):
    """`router_logits` then `route_topk` in one kernel (no expert groups): `x` `[T, D]`, router `weight` `[E, D]`
    -> (weights `[T, top_k + always]` float32, ids `[T, top_k + always]` int64). With `residual` = (delta, norm
    weight, eps), the router reads `rms_norm(x + delta)` and the call returns (total, normed, weights, ids) as
    `add_rms_norm` then the router would. One program per token and expert (each forms the whole row's norm:
    meant for decode batches); the token's last one routes it. One warp: the top-k's reductions stay in it."""
    x, weight = x.contiguous(), weight.contiguous()
    tokens, d = x.shape
    experts = weight.shape[0]
    if d > 16384 or experts > 1024:
        raise ValueError(f"router_topk takes rows up to 16384 wide and up to 1024 experts (got {d}, {experts}).")
    slots = top_k + always
    weights = torch.empty(tokens, slots, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, slots, dtype=torch.long, device=x.device)
    if residual is not None:
        delta, norm_weight, eps = residual
        delta = delta.contiguous()
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"router_topk's residual must match x (got {tuple(delta.shape)} {delta.dtype}).")
        total = torch.empty_like(x)
        normed = torch.empty(tokens, d, dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device)
    else:
        delta, norm_weight, eps, total, normed = x, x, 0.0, x, x
    if tokens:
        logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
        pdl = pdl_launch(x)
        _router_topk_kernel[(tokens, experts)](
            x, delta, norm_weight, weight, total, normed, logits,
            correction_bias if correction_bias is not None else logits, weights, ids,
            arrival_counters(x.device, "router_topk", tokens), experts, d, eps, scaling,
            RESIDUAL=residual is not None, BLOCK_D=next_power_of_2(d), TOP_K=top_k, ALWAYS=always,
            BLOCK_E=next_power_of_2(experts), BLOCK_K=next_power_of_2(slots), HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize, PDL=pdl_flag(pdl), num_warps=num_warps, **pdl)
    return (total, normed, weights, ids) if residual is not None else (weights, ids)


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
def _grouped_gemm_kernel(x_ptr, w_ptr, rows_ptr, block_expert_ptr, out_ptr, N, K, stride_x, stride_we, stride_wn,
                         stride_out, row_divisor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr):
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
        a = tl.load(x_ptr + source[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)
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


def grouped_expert_gemm(x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                        num_pairs: int, row_divisor: int, swiglu: bool = False, block_m: int = 64,
                        block_n: int | None = None, block_k: int = 64, num_warps: int = 4,
                        num_stages: int = 3) -> torch.Tensor:
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
    _grouped_gemm_kernel[grid](x, weight, rows, block_expert, out, n, k, x.stride(0), weight.stride(0),
                               weight.stride(1), out.stride(0), row_divisor, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, SWIGLU=swiglu, IEEE=x.dtype == torch.float32,
                               num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _expert_gemv_mxfp4_kernel(x_ptr, packed_ptr, scale_ptr, ids_ptr, out_ptr, N, K, top_k, stride_pe, stride_pn,
                              stride_se, stride_sn, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)  # a (token, slot) pair; its input is the token's row
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    wait_for_inputs(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    packed = packed_ptr + expert * stride_pe
    scales = scale_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
    for k0 in range(0, K, 8 * WORDS):
        x8 = _word_x(x_ptr + (pair // top_k) * K, k0, K, WORDS)
        acc += _word_rows_dot(packed, scales, offs_n, n_ok, k0, K, stride_pn, stride_sn, x8, WORDS)
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + pair * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _mxfp4_tail_step(both_ptr, packed, scales, pair, offs_n, n_ok, k0, stride_pn, stride_sn, INTER: tl.constexpr,
                     WORDS: tl.constexpr):
    """One K step of one slot of the MXFP4 decode tail: SwiGLU of the pair's activations times its down expert's
    rows -> `(BLOCK_N, WORDS / 4)` float32 group sums."""
    ks = k0 + tl.arange(0, WORDS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    up = tl.load(both_ptr + pair * 2 * INTER + ks, mask=ks < INTER, other=0.0).to(tl.float32)
    gate = tl.load(both_ptr + pair * 2 * INTER + INTER + ks, mask=ks < INTER, other=0.0).to(tl.float32)
    # rounded as the separate SwiGLU kernel's output would be, then carrying 2^64 (see WORD_X_SCALE)
    act = (up * gate * tl.sigmoid(gate)).to(both_ptr.dtype.element_ty).to(tl.float32)
    return _word_rows_dot(packed, scales, offs_n, n_ok, k0, INTER, stride_pn, stride_sn, act * 18446744073709551616.0,
                          WORDS)


@triton.jit
def _expert_swiglu_down_mxfp4_kernel(both_ptr, packed_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr, N,
                                     stride_pe, stride_pn, stride_se, stride_sn, TOP_K: tl.constexpr,
                                     INTER: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                                     UNROLL: tl.constexpr, PDL: tl.constexpr):
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
                acc += _mxfp4_tail_step(both_ptr, packed_ptr + expert * stride_pe, scale_ptr + expert * stride_se,
                                        pair, offs_n, n_ok, tl.full((), step, tl.int32), stride_pn, stride_sn, INTER,
                                        WORDS)
            total += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(acc, axis=1)
    else:
        for slot in range(0, TOP_K):
            pair = token * TOP_K + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            acc = tl.zeros((BLOCK_N, WORDS // 4), dtype=tl.float32)
            for k0 in range(0, INTER, 8 * WORDS):
                acc += _mxfp4_tail_step(both_ptr, packed_ptr + expert * stride_pe, scale_ptr + expert * stride_se,
                                        pair, offs_n, n_ok, k0, stride_pn, stride_sn, INTER, WORDS)
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


def expert_gemv_mxfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                      top_k: int = 1, block_n: int = 16, block_k: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """See `reference.expert_gemv_mxfp4`: pair p (row `p // top_k` of `x`) through its expert, decoded from the
    packed words inside the kernel (`_word_rows_dot`). Default tiles from the H200 sweep (RESULTS.md; 64 experts,
    2048 -> 1536, top 6): 16 rows x 512 K per program, 4 warps for one token's pairs (7.4 us), 2 for more (38.4 us
    at 8 tokens)."""
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
        x, packed, scales, ids.contiguous(), out, n, k, top_k, packed.stride(0), packed.stride(1), scales.stride(0),
        scales.stride(1), BLOCK_N=block_n, WORDS=block_k // 8, PDL=pdl_flag(pdl), num_warps=num_warps, **pdl)
    return out


# Up to this many tokens the MXFP4 decode tail unrolls its slots (measured better at 1, 2 and 8, worse at 32), as
# long as slots x K steps stay within MXFP4_TAIL_UNROLL_BODIES (code size and compile time grow with them).
MXFP4_TAIL_UNROLL_TOKENS = 8
MXFP4_TAIL_UNROLL_BODIES = 24  # the measured mid config unrolls 6 slots x 3 steps at 3-8 tokens


def expert_swiglu_down_mxfp4(both: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                             weights: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                             num_warps: int | None = None) -> torch.Tensor:
    """See `reference.expert_swiglu_down_mxfp4`: SwiGLU, each pair's MXFP4 down expert and the weighted slot sum in
    one kernel (one program per token and block of outputs). Defaults from the H200 sweep (RESULTS.md; 64 experts,
    768 -> 2048, top 6): up to `MXFP4_TAIL_UNROLL_TOKENS` tokens the slots unrolled, 4 warps, 8 x 1024 for one token
    (7.8 us; the slot loop: 11.5), 16 x 1024 for two (10.7; 16.2), 32 x 256 beyond (27.0 at 8; 29.7); more tokens
    loop over the slots, 32 x 256 with 2 warps (79.7 us at 32; unrolled: 97.8)."""
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
        both, packed, scales, ids.contiguous(), weights.contiguous(), out, n, packed.stride(0), packed.stride(1),
        scales.stride(0), scales.stride(1), TOP_K=top_k, INTER=inter, BLOCK_N=block_n, WORDS=block_k // 8,
        UNROLL=unroll, PDL=pdl_flag(pdl), num_warps=num_warps or (4 if unroll else 2), **pdl)
    return out
