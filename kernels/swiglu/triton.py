"""SwiGLU in one pass: read the fused up-projection once, write half as many values (or, for an FP8 GEMM next,
e4m3 values and one scale per row: a program then holds its whole row)."""

import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.triton import fp8_row, output_rows, row_fp8_warps


@triton.jit
def _swiglu_row_part(x_ptr, row, width, cols, mask):
    value = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    return value * gate * tl.sigmoid(gate)


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, width, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    out = _swiglu_row_part(x_ptr, row, width, cols, mask)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fp8_kernel(x_ptr, q_ptr, scale_ptr, width, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    q, scale = fp8_row(_swiglu_row_part(x_ptr, row, width, cols, mask))
    tl.store(q_ptr + row * out_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def swiglu(x, fp8=False, block=1024, num_warps=4, out=None):
    """Same contract as `reference.swiglu` (and its dispatcher's `out`); `block` and `num_warps` tune the bf16
    launch."""
    x = x.contiguous()
    width = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    out, stride = output_rows((*x.shape[:-1], width), x.dtype, x.device, fp8, out)
    if fp8:
        row_block = next_power_of_2(width)
        _swiglu_fp8_kernel[(rows,)](
            x, out.values, out.scale, width, stride, BLOCK=row_block, num_warps=row_fp8_warps(row_block)
        )
        return out
    _swiglu_kernel[(rows, triton.cdiv(width, block))](x, out, width, stride, BLOCK=block, num_warps=num_warps)
    return out
