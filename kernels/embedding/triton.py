"""Token embedding lookup for a decode step's few tokens in Triton, launched with programmatic dependent launch so
the first projection of the step (launched the same way) loads its weights while the rows are copied; torch's
gather is launched the ordinary way, and the projection after it could only start once it had finished."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _embedding_rows_kernel(ids_ptr, w_ptr, out_ptr, V, D, stride_w, BLOCK: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    wait_for_inputs(PDL)  # the ids may come from the kernel before (the previous step's argmax)
    row = tl.load(ids_ptr + token).to(tl.int64)
    # An id outside the table gives zeros instead of other memory (callers check ids; the engine does).
    inside = (row >= 0) & (row < V)
    values = tl.load(w_ptr + tl.where(inside, row, 0) * stride_w + cols, mask=cols < D, other=0.0)
    values = tl.where(inside, values, tl.zeros_like(values))
    tl.store(out_ptr + token * D + cols, values, mask=cols < D)


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor, block: int = 1024, num_warps: int = 2) -> torch.Tensor:
    """See `reference.embedding_rows`: `ids` `[...]` int (each in [0, V); a row of zeros for any other),
    `weight` `[V, D]` with unit inner stride -> `[..., D]`."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"embedding_rows takes a [V, D] table with unit inner stride (got {tuple(weight.shape)}).")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    d = weight.shape[1]
    out = torch.empty(flat.numel(), d, dtype=weight.dtype, device=weight.device)
    if flat.numel():
        block = min(block, next_power_of_2(d))
        pdl = pdl_launch(weight)
        _embedding_rows_kernel[(flat.numel(), triton.cdiv(d, block))](
            flat,
            weight,
            out,
            weight.shape[0],
            d,
            weight.stride(0),
            BLOCK=block,
            PDL=pdl_flag(pdl),
            num_warps=num_warps,
            **pdl,
        )
    return out.view(*ids.shape, d)
