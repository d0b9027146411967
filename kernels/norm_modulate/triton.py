"""RMSNorm + AdaLN modulation in one pass over the rows: read x once, write the modulated row once, float32 inside."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel that reads two or more rows of `block` columns."""
    return 8 if block >= 4096 else 4


@triton.jit
def modulated_rms_row(x, w_ptr, shift_ptr, scale_ptr, table_row, table_stride, cols, mask, hidden, eps,
                      HAS_WEIGHT: tl.constexpr):
    """One float32 row `x` -> `rms_norm(x) * w * (1 + scale[table_row]) + shift[table_row]` (float32)."""
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + table_row * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + table_row * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    return y * (1.0 + scale) + shift


@triton.jit
def _rmsnorm_modulate_kernel(x_ptr, w_ptr, shift_ptr, scale_ptr, index_ptr, out_ptr, seq_len, hidden, table_stride,
                             eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over batch * seq_len
    table_row = tl.load(index_ptr + row % seq_len).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    out = modulated_rms_row(x, w_ptr, shift_ptr, scale_ptr, table_row, table_stride, cols, mask, hidden, eps,
                            HAS_WEIGHT)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_modulate(x, weight, shift, scale, index, eps, num_warps=None):
    """Same contract as `reference.rmsnorm_modulate`; `shift`/`scale` may be column slices of one table."""
    x = x.contiguous()
    batch, seq_len, hidden = x.shape
    out = torch.empty_like(x)
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    block = next_power_of_2(hidden)
    _rmsnorm_modulate_kernel[(batch * seq_len,)](
        x, weight if weight is not None else x, shift, scale, index, out, seq_len, hidden, shift.stride(0), eps,
        HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=num_warps or 4,  # 4 measured best (RESULTS.md)
    )
    return out
