"""RMSNorm in one pass (one program per row), with the reference's two roundings: the normalised value to x.dtype,
then the product with the weight to the output dtype."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `reference.rms_norm`. `x` may be a strided view whose last axis is contiguous."""
    shape = x.shape
    dim = shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), dim, eps, BLOCK=block,
                                           num_warps=8 if block >= 4096 else 4)
    return out.view(shape)
