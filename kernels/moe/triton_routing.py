"""The router in Triton: `router_logits` (float32 logits, no casts), `route_topk` (sigmoid, correction bias,
top-k, renormalise, scale; one program per token) and `router_topk` (both, optionally after the residual add and
norm, in one launch: one program per token and expert, the token's last-arriving program routes it)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._arrivals import arrival_counters
from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, E, D, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
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


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, block_e: int = 1, block_d: int | None = None, num_warps: int = 4
) -> torch.Tensor:
    """See `reference.router_logits`: one program per token and `block_e` experts, float32 math on the stored
    dtypes (no cast copies). One expert per program measured best (H200, 64 x 2048: 1.9 us against 6.1 us for
    torch's cast + float32 linear)."""
    x, weight = x.contiguous(), weight.contiguous()
    tokens, d = x.shape
    experts = weight.shape[0]
    out = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    block_d = block_d or min(2048, max(16, next_power_of_2(d)))
    pdl = pdl_launch(x)
    _router_logits_kernel[(tokens, triton.cdiv(experts, block_e))](
        x, weight, out, experts, d, BLOCK_E=block_e, BLOCK_D=block_d, PDL=pdl_flag(pdl), num_warps=num_warps, **pdl
    )
    return out


@triton.jit
def _route_token(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    token,
    experts,
    scaling,
    TOP_K: tl.constexpr,
    ALWAYS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Route `token` from its float32 logits row (read from L2: other programs may have just written it) and store
    its `TOP_K + ALWAYS` weights (float32) and expert ids (int64). Sigmoid scores, the correction bias for the selection
    only, the best first (topk's order), optionally renormalised, times `scaling`; always-on experts E, E + 1, ... after
    them with weight 1.

    The selection runs on int32 keys (the float's bits made monotonic; NaN above everything, as in topk): the best
    remaining key, the lowest index holding it, that expert's score bits (scores are >= 0, so their bits order as
    they do) are three integer reductions per slot, which a warp does in one instruction each (`redux`), where
    float reductions take a chain of shuffles."""
    es = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    valid = es < experts
    scores = tl.sigmoid(
        tl.load(logits_ptr + token * experts + es, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32)
    )
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + es, mask=valid, other=0.0).to(tl.float32)
    bits = tl.where(valid, choice, float("-inf")).to(tl.int32, bitcast=True)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    score_bits = scores.to(tl.int32, bitcast=True)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    chosen_bits = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):  # the best remaining expert, TOP_K times (topk's order: best first)
        best = tl.max(keys, axis=0)
        index = tl.min(tl.where(keys == best, es, BLOCK_E - 1), axis=0)
        chosen_id = tl.where(ks == slot, index, chosen_id)
        chosen_bits = tl.where(ks == slot, tl.max(tl.where(es == index, score_bits, 0), axis=0), chosen_bits)
        keys = tl.where(es == index, -2147483647 - 1, keys)  # below every key, -inf's included
    chosen_w = chosen_bits.to(tl.float32, bitcast=True)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    routed = ks < TOP_K
    chosen_w = tl.where(routed, chosen_w * scaling, 1.0)
    chosen_id = tl.where(routed, tl.minimum(chosen_id, experts - 1).to(tl.int64), experts + ks - TOP_K)
    keep = ks < TOP_K + ALWAYS
    tl.store(weights_ptr + token * (TOP_K + ALWAYS) + ks, chosen_w, mask=keep)
    tl.store(ids_ptr + token * (TOP_K + ALWAYS) + ks, chosen_id, mask=keep)


@triton.jit
def _route_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    experts,
    scaling,
    TOP_K: tl.constexpr,
    ALWAYS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    wait_for_inputs(PDL)
    _route_token(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        token,
        experts,
        scaling,
        TOP_K,
        ALWAYS,
        BLOCK_E,
        BLOCK_K,
        HAS_BIAS,
        RENORMALIZE,
    )


@triton.jit
def _router_topk_kernel(
    x_ptr,
    delta_ptr,
    nw_ptr,
    w_ptr,
    total_ptr,
    normed_ptr,
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    count_ptr,
    experts,
    D,
    eps,
    scaling,
    RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOP_K: tl.constexpr,
    ALWAYS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
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
            x_ptr.dtype.element_ty
        )
        v = total.to(tl.float32)
        normed = (v * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        row = (norm_w * normed).to(normed_ptr.dtype.element_ty)
        if expert == 0:
            tl.store(total_ptr + token * D + ds, total, mask=ok)
            tl.store(normed_ptr + token * D + ds, row, mask=ok)
    tl.store(logits_ptr + token * experts + expert, tl.sum(w * row.to(tl.float32), axis=0))
    tl.debug_barrier()  # every thread's stores come before the count, which its atomic releases
    if tl.atomic_add(count_ptr + token, 1, sem="acq_rel", scope="gpu") == experts - 1:  # all logits are stored
        _route_token(
            logits_ptr,
            bias_ptr,
            weights_ptr,
            ids_ptr,
            token,
            experts,
            scaling,
            TOP_K,
            ALWAYS,
            BLOCK_E,
            BLOCK_K,
            HAS_BIAS,
            RENORMALIZE,
        )
        tl.store(count_ptr + token, 0)  # ready for the next launch (and graph replay)


def route_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool = True,
    scaling: float = 1.0,
    always: int = 0,
):
    """`reference.route_topk` without expert groups, one program per token: `logits` `[T, E]` -> (weights
    `[T, top_k + always]` float32, ids `[T, top_k + always]` int64)."""
    logits = logits.float().contiguous()
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k + always, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + always, dtype=torch.long, device=logits.device)
    if tokens:
        pdl = pdl_launch(logits)
        _route_topk_kernel[(tokens,)](
            logits,
            correction_bias if correction_bias is not None else logits,
            weights,
            ids,
            experts,
            scaling,
            TOP_K=top_k,
            ALWAYS=always,
            BLOCK_E=next_power_of_2(experts),
            BLOCK_K=next_power_of_2(top_k + always),
            HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize,
            PDL=pdl_flag(pdl),
            num_warps=1 if experts <= 256 else 4,
            **pdl,
        )
    return weights, ids


def router_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool = True,
    scaling: float = 1.0,
    always: int = 0,
    residual=None,
    num_warps: int = 1,
):
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
            x,
            delta,
            norm_weight,
            weight,
            total,
            normed,
            logits,
            correction_bias if correction_bias is not None else logits,
            weights,
            ids,
            arrival_counters(x.device, "router_topk", tokens),
            experts,
            d,
            eps,
            scaling,
            RESIDUAL=residual is not None,
            BLOCK_D=next_power_of_2(d),
            TOP_K=top_k,
            ALWAYS=always,
            BLOCK_E=next_power_of_2(experts),
            BLOCK_K=next_power_of_2(slots),
            HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize,
            PDL=pdl_flag(pdl),
            num_warps=num_warps,
            **pdl,
        )
    return (total, normed, weights, ids) if residual is not None else (weights, ids)
