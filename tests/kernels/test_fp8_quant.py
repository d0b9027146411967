"""E4M3 quantization (per row, per (batch, head)): the Triton kernels against the torch reference, the
reference's round trip against the input."""

import pytest
import torch
from kernel_cases import (DEVICE, DTYPES, ON_GPU, assert_same_fp8, assert_same_rows, case as _case,
                          dequantized as _dequantized, err as _err, rand as _rand)

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
    fused = _rand(2, 67, 3 * 5 * 32, dtype=dtype, generator=g) * torch.logspace(-2, 2, 5, device=DEVICE).repeat_interleave(32).repeat(3).to(dtype)
    v = fused[..., 2 * 5 * 32 :].unflatten(-1, (5, 32))  # the v third of a fused qkv buffer: rows strided
    values, descale = quant_triton.quantize_heads(v, block_s=16)
    ref_values, ref_descale = quant_ref.quantize_heads(v)
    assert values.is_contiguous() and descale.shape == (2, 5)
    assert torch.allclose(descale, ref_descale, rtol=1e-6, atol=0)
    assert_same_fp8(values, ref_values)
    dense = _dequantized(values, ref_values).reshape(v.shape) * descale[:, None, :, None]
    assert _err(dense, v) < 0.05
