"""Gated residual (optionally fused with the next RMSNorm + modulation): one read of x and y per row."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.triton import row_fp8_warps
from h3gen.kernels.norm_modulate.triton import modulated_rms_row, row_output, row_warps, store_row


@triton.jit
def _gated_residual_kernel(
    x_ptr,
    y_ptr,
    gate_ptr,
    index_ptr,
    out_ptr,
    w_ptr,
    shift_ptr,
    scale_ptr,
    mod_ptr,
    mod_scale_ptr,
    seq_len,
    hidden,
    mod_stride,
    gate_stride,
    table_stride,
    eps,
    FUSE_NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    FP8_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    table_row = tl.load(index_ptr + row % seq_len).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + table_row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    x_new = (x + gate * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, x_new, mask=mask)
    if FUSE_NORM:  # normalise the stored (rounded) residual, as the next half-block will see it
        modulated = modulated_rms_row(
            x_new.to(tl.float32),
            w_ptr,
            shift_ptr,
            scale_ptr,
            table_row,
            table_stride,
            cols,
            mask,
            hidden,
            eps,
            HAS_WEIGHT,
        )
        store_row(mod_ptr, mod_scale_ptr, row, mod_stride, cols, mask, modulated, FP8_OUT)


def _launch(
    x, y, gate, index, out, weight=None, shift=None, scale=None, modulated=None, eps=0.0, num_warps=None, mod_stride=0
):
    """`modulated`: None (the residual update alone), or the norm's output buffers (values, scales), their rows
    `mod_stride` elements apart."""
    batch, seq_len, hidden = x.shape
    fuse = modulated is not None
    fp8 = fuse and modulated[0].dtype != x.dtype
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if fuse and (shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0)):
        shift, scale = shift.contiguous(), scale.contiguous()
    block = next_power_of_2(hidden)
    _gated_residual_kernel[(batch * seq_len,)](
        x,
        y,
        gate,
        index,
        out,
        weight if weight is not None else x,
        shift if fuse else gate,
        scale if fuse else gate,
        *(modulated if fuse else (out, out)),
        seq_len,
        hidden,
        mod_stride,
        gate.stride(0),
        shift.stride(0) if fuse else 0,
        eps,
        FUSE_NORM=fuse,
        HAS_WEIGHT=weight is not None,
        FP8_OUT=fp8,
        BLOCK=block,
        num_warps=num_warps or (row_fp8_warps(block) if fp8 else row_warps(block)),
    )


def gated_residual(x, y, gate, index, out=None, num_warps=None):
    """`x + gate[index] * y`; `out=x` updates the residual stream in place."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x) if out is None else out
    _launch(x, y, gate, index, out, num_warps=num_warps)
    return out


def gated_residual_norm_modulate(
    x, y, gate, index, weight, shift, scale, eps, out=None, fp8=False, num_warps=None, normed_out=None
):
    """Both results of the reference function in one pass; `out=x` updates the residual in place, `normed_out`
    receives the second (rows possibly strided)."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x) if out is None else out
    modulated, buffers, stride = row_output(x, fp8, normed_out)
    _launch(x, y, gate, index, out, weight, shift, scale, buffers, eps, num_warps=num_warps, mod_stride=stride)
    return out, modulated
