"""RMSNorm + AdaLN modulation in one pass over the rows: read x once, write the modulated row once, float32 inside."""

import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels.fp8_quant.triton import fp8_row, output_rows, row_fp8_warps


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel that reads two or more rows of `block` columns."""
    return 8 if block >= 4096 else 4


@triton.jit
def modulated_rms_row(
    x, w_ptr, shift_ptr, scale_ptr, table_row, table_stride, cols, mask, hidden, eps, HAS_WEIGHT: tl.constexpr
):
    """One float32 row `x` -> `rms_norm(x) * w * (1 + scale[table_row]) + shift[table_row]` (float32)."""
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + table_row * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + table_row * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    return y * (1.0 + scale) + shift


@triton.jit
def store_row(out_ptr, out_scale_ptr, row, out_stride, cols, mask, y, FP8_OUT: tl.constexpr):
    """Store a float32 row (`out_stride` elements apart): rounded to the output dtype, or (`FP8_OUT`) quantized to
    e4m3 with its row scale."""
    if FP8_OUT:
        y, scale = fp8_row(y)
        tl.store(out_scale_ptr + row, scale)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_modulate_kernel(
    x_ptr,
    w_ptr,
    shift_ptr,
    scale_ptr,
    index_ptr,
    out_ptr,
    out_scale_ptr,
    seq_len,
    hidden,
    out_stride,
    table_stride,
    eps,
    HAS_WEIGHT: tl.constexpr,
    FP8_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # over batch * seq_len
    table_row = tl.load(index_ptr + row % seq_len).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    out = modulated_rms_row(
        x, w_ptr, shift_ptr, scale_ptr, table_row, table_stride, cols, mask, hidden, eps, HAS_WEIGHT
    )
    store_row(out_ptr, out_scale_ptr, row, out_stride, cols, mask, out, FP8_OUT)


def row_output(x, fp8: bool, out=None):
    """The output of a row kernel over `x` `(B, S, H)`: a tensor like `x`, or `Fp8Rows`; the buffers to pass
    (values, scales); and the row stride of the values. `out`, if given, is used instead of a new one."""
    out, stride = output_rows(x.shape, x.dtype, x.device, fp8, out)
    return out, ((out.values, out.scale) if fp8 else (out, out)), stride


def rmsnorm_modulate(x, weight, shift, scale, index, eps, fp8=False, num_warps=None, out=None):
    """Same contract as `reference.rmsnorm_modulate` (and its dispatcher's `out`); `shift`/`scale` may be column
    slices of one table."""
    x = x.contiguous()
    batch, seq_len, hidden = x.shape
    result, (out, out_scale), stride = row_output(x, fp8, out)
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    block = next_power_of_2(hidden)
    _rmsnorm_modulate_kernel[(batch * seq_len,)](
        x,
        weight if weight is not None else x,
        shift,
        scale,
        index,
        out,
        out_scale,
        seq_len,
        hidden,
        stride,
        shift.stride(0),
        eps,
        HAS_WEIGHT=weight is not None,
        FP8_OUT=fp8,
        BLOCK=block,
        # bf16: 4 warps measured best on the H200 (8,192 rows 0.084 ms, 8 warps 0.091)
        num_warps=num_warps or (row_fp8_warps(block) if fp8 else 4),
    )
    return result
