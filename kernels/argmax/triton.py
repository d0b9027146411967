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
def _argmax_kernel(
    x_ptr,
    value_ptr,
    index_ptr,
    count_ptr,
    out_ptr,
    V,
    stride_x,
    chunks,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
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


# Keys: a kernel that produces the values (the head's GEMV) can leave the argmax as one 64-bit key per row and
# value: the value's float32 bits made monotonic (NaN above everything, -0 as +0) above the index's complement, so
# the largest key is the largest value at its first index, a NaN's if there is one (as torch's argmax). It maxes
# its keys into `KEY_SLOTS` slots per row (`red.max`, no waiting; slots spread the contention); `argmax_from_keys`
# then reads them back as indices and zeroes them for the next launch.
KEY_SLOTS = tl.constexpr(32)


@triton.jit
def argmax_key(values, index):
    """uint64 keys of float32 `values` at int32 `index`es (see above); padding should be masked to 0 by the caller."""
    v = tl.where(values == 0, 0.0, values)
    bits = v.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    ordered = tl.where(values != values, 0xFFFFFFFF, ordered)
    return (ordered.to(tl.uint64) << 32) | (0xFFFFFFFF - index.to(tl.uint32)).to(tl.uint64)


@triton.jit
def max_keys_into(keys_ptr, rows, row_ok, keys, part):
    """Max each row's `keys` `[ROWS]` (uint64) into slot `part % KEY_SLOTS` of its slots at `keys_ptr` (int64)."""
    slots = keys_ptr.to(tl.pointer_type(tl.uint64)) + rows * KEY_SLOTS + part % KEY_SLOTS
    tl.atomic_max(slots, keys, mask=row_ok, sem="relaxed", scope="gpu")


@triton.jit
def _keys_argmax_kernel(keys_ptr, out_ptr, M, ROWS: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, ROWS)
    slots = tl.arange(0, KEY_SLOTS)
    where = keys_ptr.to(tl.pointer_type(tl.uint64)) + rows[:, None] * KEY_SLOTS + slots[None, :]
    ok = (rows < M)[:, None]
    wait_for_inputs(PDL)
    best = tl.max(tl.load(where, mask=ok, other=0, cache_modifier=".cg"), axis=1)
    tl.store(out_ptr + rows, (0xFFFFFFFF - (best & 0xFFFFFFFF)).to(tl.int64), mask=rows < M)
    tl.store(where, tl.zeros((ROWS, KEY_SLOTS), dtype=tl.uint64), mask=ok)  # ready for the next launch


def key_slots(device: torch.device, rows: int) -> torch.Tensor:
    """The zeroed int64 key slots `[rows * KEY_SLOTS]` of a kernel that leaves its rows' argmax as keys (one buffer
    per device, as `arrival_counters`; the same tensor every call, so graphs can replay it)."""
    return arrival_counters(device, "argmax_keys", 2 * rows * KEY_SLOTS).view(torch.int64)[: rows * KEY_SLOTS]


def argmax_from_keys(keys: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `[rows]` int64 argmax that a kernel left in `keys` (from `key_slots`), which are zeroed again; written
    into `out` (contiguous `[rows]` int64) when given."""
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=keys.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(
            f"argmax_from_keys writes a contiguous [{rows}] int64 tensor (got {tuple(out.shape)} {out.dtype})."
        )
    if rows:
        pdl = pdl_launch(keys)
        _keys_argmax_kernel[(1,)](keys, out, rows, ROWS=next_power_of_2(rows), PDL=pdl_flag(pdl), num_warps=1, **pdl)
    return out


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
    _argmax_kernel[(rows, chunks)](
        x,
        values,
        indices,
        counts,
        out,
        width,
        x.stride(0),
        chunks,
        BLOCK=block,
        CHUNKS=slots,
        PDL=pdl_flag(pdl),
        num_warps=num_warps,
        **pdl,
    )
    return out
