"""`draw_token` in one Triton program per row (after the sort, when top-k / top-p need one): the row's maximum
(the first value when sorted), the top-k threshold, the kept mass, the top-p cut, then the exponential race over the
kept tokens, walking the row in chunks. A sort and the noise are two launches before it; the torch composition this
replaces was about twenty small kernels (softmax, cumsum, scatter, `multinomial`'s checks)."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2


@triton.jit
def _draw_kernel(
    values_ptr,
    order_ptr,
    noise_ptr,
    out_ptr,
    V,
    temperature,
    top_k,
    top_p,
    stride_values,
    stride_order,
    stride_noise,
    SORTED: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # one program per row, every row by the same parameters
    values_ptr += row * stride_values
    order_ptr += row * stride_order
    noise_ptr += row * stride_noise
    out_ptr += row
    offs = tl.arange(0, BLOCK)
    if SORTED:
        top = tl.load(values_ptr).to(tl.float32) / temperature
    else:
        running = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            running = tl.maximum(
                running, tl.load(values_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
            )
        top = tl.max(running, axis=0)
    kth = float("-inf")
    if TOP_K:
        kth = tl.load(values_ptr + top_k - 1).to(tl.float32) / temperature
    # kept by top-k: a prefix of the sorted row (ties with the k-th included); `end` is where it stops
    end = V
    if TOP_P:
        mass = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            scaled = tl.load(values_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
            mass += tl.where((cols < V) & (scaled >= kth), tl.exp(scaled - top), 0.0)
        budget = top_p * tl.sum(mass, axis=0)
        # the first token whose mass ahead reaches the budget ends the kept prefix (never the first token)
        ahead = 0.0
        end = V
        for start in range(0, V, BLOCK):
            if end == V:
                cols = start + offs
                scaled = tl.load(values_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
                w = tl.where((cols < V) & (scaled >= kth), tl.exp(scaled - top), 0.0)
                before = ahead + tl.cumsum(w, axis=0) - w
                end = tl.minimum(end, tl.min(tl.where((before >= budget) & (cols < V), cols, V), axis=0))
                ahead += tl.sum(w, axis=0)
    best_score = tl.full((BLOCK,), -1.0, tl.float32)
    best_index = tl.full((BLOCK,), V, tl.int32)
    for start in range(0, V, BLOCK):
        if start < end:
            cols = start + offs
            ok = cols < end
            scaled = tl.load(values_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            w = tl.where(ok & (scaled >= kth), tl.exp(scaled - top), 0.0)
            score = tl.where(w > 0, w / tl.load(noise_ptr + cols, mask=ok, other=1.0), 0.0)
            better = score > best_score  # strictly: the earliest column keeps a tie, as argmax does
            best_index = tl.where(better, cols, best_index)
            best_score = tl.where(better, score, best_score)
    winner = tl.max(best_score, axis=0)
    index = tl.min(tl.where(best_score == winner, best_index, V), axis=0)
    if SORTED:
        tl.store(out_ptr, tl.load(order_ptr + index))
    else:
        tl.store(out_ptr, index.to(tl.int64))


def draw_tokens(
    values: torch.Tensor,
    order: torch.Tensor | None,
    noise: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    block: int = 4096,
    num_warps: int = 8,
) -> torch.Tensor:
    """See `reference.draw_tokens`: `values`, `order`, `noise` `[B, V]` with unit inner strides -> `[B]` int64, one
    program per row."""
    rows, width = values.shape
    sorted_ = order is not None
    if not sorted_ and (top_k > 0 or top_p < 1.0):
        raise ValueError("draw_token: top-k and top-p need the values sorted (pass their order).")
    if values.stride(-1) != 1 or noise.stride(-1) != 1 or (sorted_ and order.stride(-1) != 1):
        raise ValueError("draw_tokens needs rows with unit inner stride.")
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows == 0:
        return out
    use_k = sorted_ and 0 < top_k < width
    source = order if sorted_ else values
    _draw_kernel[(rows,)](
        values,
        source,
        noise,
        out,
        width,
        float(temperature),
        int(top_k) if use_k else 1,
        float(top_p),
        values.stride(0),
        source.stride(0),
        noise.stride(0),
        SORTED=sorted_,
        TOP_K=use_k,
        TOP_P=sorted_ and top_p < 1.0,
        BLOCK=min(block, next_power_of_2(width)),
        num_warps=num_warps,
    )
    return out


def draw_token(
    values: torch.Tensor,
    order: torch.Tensor | None,
    noise: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    block: int = 4096,
    num_warps: int = 8,
) -> torch.Tensor:
    """See `reference.draw_token`: one row `[V]` -> `[1]` int64."""
    return draw_tokens(
        values.contiguous()[None],
        None if order is None else order.contiguous()[None],
        noise.contiguous()[None],
        temperature,
        top_k,
        top_p,
        block,
        num_warps,
    )
