"""Row argmax over a wide row (a decode step's logits: one to a few rows of 32k-200k values) in Triton. torch's
reduction gives each row one block (about 12 us for 32,768 bf16 logits on an H200); here each row is cut into
chunks, each program reduces its chunk to (value, first index), and the row's last-arriving program (an arrival
counter, see `_arrivals.py`) reduces the chunks' results. Launched with PDL like the kernels before it."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._arrivals import arrival_counters
from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _first_max(values, index, limit):
    """(value, first index) of the largest of `values` (float32, with their `index`es; entries at `limit` or beyond
    are padding); a NaN is the largest, as in torch. The value is NaN when the result is a NaN."""
    nan = values != values
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    real = tl.where(nan | (index >= limit), float("-inf"), values)
    best = tl.max(real, axis=0)
    first_best = tl.min(tl.where((real == best) & (index < limit), index, limit), axis=0)
    first_nan = tl.min(tl.where(nan & (index < limit), index, limit), axis=0)
    return tl.where(any_nan, float("nan"), best), tl.where(any_nan, first_nan, first_best)


@triton.jit
def _argmax_kernel(x_ptr, value_ptr, index_ptr, count_ptr, out_ptr, V, stride_x, chunks, BLOCK: tl.constexpr,
                   CHUNKS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    wait_for_inputs(PDL)
    values = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    value, index = _first_max(values, cols, V)
    if CHUNKS == 1:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        tl.store(value_ptr + row * CHUNKS + chunk, value)
        tl.store(index_ptr + row * CHUNKS + chunk, index)
        tl.debug_barrier()  # the stores come before the count, which its atomic releases
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == chunks - 1:  # every chunk is stored
            slots = tl.arange(0, CHUNKS)
            ok = slots < chunks
            maxima = tl.load(value_ptr + row * CHUNKS + slots, mask=ok, other=float("-inf"), cache_modifier=".cg")
            firsts = tl.load(index_ptr + row * CHUNKS + slots, mask=ok, other=V, cache_modifier=".cg")
            # chunks are in index order, so the first chunk holding the maximum holds its first index
            _, best = _first_max(maxima, firsts, V)
            tl.store(out_ptr + row, best.to(tl.int64))
            tl.store(count_ptr + row, 0)  # ready for the next launch (and graph replay)


def argmax_rows(x: torch.Tensor, block: int = 4096, num_warps: int = 4) -> torch.Tensor:
    """See `reference.argmax_rows`: `x` `[B, V]` (last axis contiguous) -> `[B]` int64."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if width == 0:
        raise ValueError("argmax_rows: the rows are empty (width 0).")
    block = min(block, next_power_of_2(width))
    chunks = triton.cdiv(width, block)
    slots = next_power_of_2(chunks)
    values = torch.empty(rows * slots, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows * slots, dtype=torch.int32, device=x.device)
    counts = arrival_counters(x.device, "argmax", rows) if chunks > 1 else out
    pdl = pdl_launch(x)
    _argmax_kernel[(rows, chunks)](x, values, indices, counts, out, width, x.stride(0), chunks, BLOCK=block,
                                   CHUNKS=slots, PDL=pdl_flag(pdl), num_warps=num_warps, **pdl)
    return out
