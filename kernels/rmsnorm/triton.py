"""RMSNorm in one pass (one program per row), with the reference's two roundings: the normalised value to x.dtype,
then the product with the weight to the output dtype; optionally after a residual add in the same pass."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr, y_ptr, sum_ptr, w_ptr, out_ptr, stride_x, dim, eps, ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual update first, rounded and stored; the norm reads the rounded sum
        x += tl.load(y_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * dim + cols, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype=None):
    shape = x.shape
    dim = shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype or torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = None if y is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = next_power_of_2(dim)
        extra = (rows, rows) if y is None else (y.reshape(-1, dim).contiguous(), total)
        pdl = pdl_launch(rows)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            *extra,
            weight,
            out,
            rows.stride(0),
            dim,
            eps,
            ADD=y is not None,
            BLOCK=block,
            PDL=pdl_flag(pdl),
            num_warps=8 if block >= 4096 else 4,
            **pdl,
        )
    return out.view(shape) if total is None else (total.view(shape), out.view(shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """See `reference.rms_norm`. `x` may be a strided view whose last axis is contiguous."""
    return _launch(x, None, weight, eps, out_dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """See `reference.add_rms_norm` (`x` and `y` of one dtype and shape)."""
    return _launch(x, y, weight, eps)
