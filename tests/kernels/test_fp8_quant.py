"""E4M3 quantization (per row, per (batch, head)): the Triton kernels against the torch reference, the
reference's round trip against the input."""

import pytest
import torch
from helpers.kernel_cases import DEVICE, DTYPES, ON_GPU, assert_same_fp8, assert_same_rows
from helpers.kernel_cases import case as _case
from helpers.kernel_cases import dequantized as _dequantized
from helpers.kernel_cases import err as _err
from helpers.kernel_cases import rand as _rand

from h3gen.kernels.fp8_quant import reference as quant_ref
from h3gen.kernels.fp8_quant import triton as quant_triton


@pytest.mark.skipif(not ON_GPU, reason="bf16 rows: the interpreter gets bf16 wrong")
def test_quantize_rows_of_wide_bf16_activations():
    """Rows as wide as the FFN's down projection takes, in bf16: the scales agree and every e4m3 value is within one
    rounding step (one code) of the reference's."""
    x = _rand(33, 14336, dtype=torch.bfloat16, generator=_case(6))
    assert_same_rows(quant_triton.quantize_rows(x), quant_ref.quantize_rows(x), x.float())


def test_fp8_reference_quantization_roundtrip():
    from h3gen.kernels.fp8_quant.reference import quantize_rows

    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(7)) * torch.logspace(-3, 3, 9)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (9, 1)
    assert _err(q.float() * scale, x) < 0.05  # e4m3 keeps 3 mantissa bits: a few percent


def test_quantize_rows_keeps_the_shape():
    x = _rand(2, 9, 70, dtype=torch.float32, generator=_case(13)) * torch.logspace(-3, 3, 70, device=DEVICE)
    got, expected = quant_triton.quantize_rows(x), quant_ref.quantize_rows(x)
    assert got.values.shape == x.shape and got.scale.shape == (18, 1)
    assert_same_rows(got, expected, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_heads_matches_reference_on_a_strided_view(dtype):
    g = _case(15)
    fused = _rand(2, 67, 3 * 5 * 32, dtype=dtype, generator=g) * torch.logspace(
        -2, 2, 5, device=DEVICE
    ).repeat_interleave(32).repeat(3).to(dtype)
    v = fused[..., 2 * 5 * 32 :].unflatten(-1, (5, 32))  # the v third of a fused qkv buffer: rows strided
    values, descale = quant_triton.quantize_heads(v, block_s=16)
    ref_values, ref_descale = quant_ref.quantize_heads(v)
    assert values.is_contiguous() and descale.shape == (2, 5)
    assert torch.allclose(descale, ref_descale, rtol=1e-6, atol=0)
    assert_same_fp8(values, ref_values)
    dense = _dequantized(values, ref_values).reshape(v.shape) * descale[:, None, :, None]
    assert _err(dense, v) < 0.05


@pytest.mark.parametrize("peak", [100.0, 3000.0])
def test_append_scaled_columns_grows_a_rows_scale_only_where_its_new_columns_need_it(peak):
    """The last columns of e4m3 rows take `projected / factors`; a row whose values would pass 448 multiplies its
    scale by a power of two and divides its first values by it. Triton against the reference, and the dequantized
    rows equal `[x | projected * scale / factors]` within e4m3 rounding."""
    from h3gen.kernels.fp8_quant import reference as fp8_ref
    from h3gen.kernels.fp8_quant import triton as fp8_triton

    g = _case(5)
    rows, width, extra = 9, 70, 20
    x = torch.randn(rows, width, generator=g, device=DEVICE)
    quantized = fp8_ref.quantize_rows(x)
    projected = torch.randn(rows, extra, generator=g, device=DEVICE) * peak / 3
    projected[0] = 0.0
    factors = torch.rand(extra, generator=g, device=DEVICE) + 0.5
    results = []
    for module in (fp8_ref, fp8_triton):
        values = torch.zeros(rows, width + extra, device=DEVICE).to(fp8_ref.FP8)
        values[:, :width] = quantized.values
        scale = quantized.scale.clone()
        module.append_scaled_columns(values, scale, projected, factors)
        results.append((values, scale))
    (ref_values, ref_scale), (got_values, got_scale) = results
    assert torch.equal(got_scale, ref_scale)
    assert_same_fp8(got_values, ref_values)
    grown = (ref_scale / quantized.scale).flatten()
    assert torch.all(grown == torch.exp2(torch.round(torch.log2(grown))))  # powers of two
    assert (grown > 1).any() == (peak > 448 * 0.5 * 3)  # only where the new columns pass 448
    want = torch.cat([x, projected * quantized.scale / factors], dim=1)
    assert _err(_dequantized(got_values, ref_values) * got_scale, want) < 0.06
