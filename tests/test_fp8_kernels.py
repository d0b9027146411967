"""The kernels' e4m3 outputs (the `fast` tier's fused quantization) against their torch references: on the CPU
under TRITON_INTERPRET=1 with fp32/fp16 inputs, on a GPU with bf16 and fp32."""

import pytest
import torch
from kernel_cases import (DEVICE, DTYPES, ON_GPU, SHAPES, case as _case, err as _err, half_block_inputs, qk_inputs,
                          rand as _rand)

from h3gen.kernels.attention import attention, fp8_attention  # noqa: E402
from h3gen.kernels.fp8_quant import Fp8Rows  # noqa: E402
from h3gen.kernels.fp8_quant import reference as quant_ref  # noqa: E402
from h3gen.kernels.fp8_quant import triton as quant_triton  # noqa: E402
from h3gen.kernels.gated_residual import reference as residual_ref  # noqa: E402
from h3gen.kernels.gated_residual import triton as residual_triton  # noqa: E402
from h3gen.kernels.norm_modulate import reference as norm_ref  # noqa: E402
from h3gen.kernels.norm_modulate import triton as norm_triton  # noqa: E402
from h3gen.kernels.qk_norm_rope import reference as rope_ref  # noqa: E402
from h3gen.kernels.qk_norm_rope import triton as rope_triton  # noqa: E402
from h3gen.kernels.swiglu import reference as swiglu_ref  # noqa: E402
from h3gen.kernels.swiglu import triton as swiglu_triton  # noqa: E402

def assert_same_fp8(got: torch.Tensor, expected: torch.Tensor):
    """Two e4m3 tensors equal up to one rounding step (kernel and reference round float32 values computed in a
    different order). Under the CPU interpreter its e4m3 cast also drops the carry into the next power of two
    (7.9 -> 4 where 8 is right, 0.0017 -> 0 where 2^-9 is), which a GPU never does: allowed there only."""
    assert got.dtype == expected.dtype == torch.float8_e4m3fn and got.shape == expected.shape
    g, e = got.float(), expected.float()
    codes = (got.view(torch.uint8).int() - expected.view(torch.uint8).int()).abs()
    ok = (g == e) | ((codes <= 1) & (g.sign() == e.sign()))
    if not ON_GPU:
        ok |= ((2 * g == e) | (g == 0)) & (e.abs().log2() == e.abs().log2().round())
    assert ok.all(), f"{(~ok).sum().item()} of {ok.numel()} e4m3 values differ by more than one step"


def assert_same_rows(got: Fp8Rows, expected: Fp8Rows, source: torch.Tensor):
    assert isinstance(got, Fp8Rows) and got.scale.shape == expected.scale.shape
    assert torch.allclose(got.scale, expected.scale, rtol=1e-5, atol=0)
    assert_same_fp8(got.values, expected.values)
    assert _err(_dequantized(got.values, expected.values) * got.scale, source.reshape(-1, source.shape[-1])) < 0.05


def _dequantized(got, expected):
    """The values to check the quantization error on: the kernel's on a GPU; the reference's under the CPU
    interpreter (whose carry bug, allowed by `assert_same_fp8`, would dominate the error)."""
    values = got if ON_GPU else expected
    return values.reshape(-1, values.shape[-1]).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_kernels_write_fp8_rows(shape, dtype):
    batch, seq, hidden = shape
    x, y, weight, gate, shift, scale, index = half_block_inputs(shape, dtype, seed=11)

    got = norm_triton.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=True)
    expected = norm_ref.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=True)
    assert got.values.shape == x.shape and got.scale.shape == (batch * seq, 1)
    dense = norm_ref.rmsnorm_modulate(x.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert_same_rows(got, expected, dense)

    x_new, got = residual_triton.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, 1e-5,
                                                              fp8=True)
    ref_new = residual_ref.gated_residual(x.float(), y.float(), gate.float(), index)
    assert x_new.dtype == dtype and _err(x_new, ref_new) < {torch.float32: 1e-6}.get(dtype, 1e-2)
    # The norm reads the rounded residual the kernel stored: compare with the reference's norm of that same row.
    expected = norm_ref.rmsnorm_modulate(x_new, weight, shift, scale, index, 1e-5, fp8=True)
    dense = norm_ref.rmsnorm_modulate(x_new.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert_same_rows(got, expected, dense)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 13, 2 * 300), (2, 3, 2 * 1500), (4, 2 * 64)])
def test_swiglu_writes_fp8_rows(shape, dtype):
    x = _rand(*shape, dtype=dtype, generator=_case(12), scale=3.0)
    got = swiglu_triton.swiglu(x, fp8=True)
    assert got.values.shape == (*shape[:-1], shape[-1] // 2)
    assert_same_rows(got, swiglu_ref.swiglu(x, fp8=True), swiglu_ref.swiglu(x.float()))


def test_quantize_rows_keeps_the_shape():
    x = _rand(2, 9, 70, dtype=torch.float32, generator=_case(13)) * torch.logspace(-3, 3, 70, device=DEVICE)
    got, expected = quant_triton.quantize_rows(x), quant_ref.quantize_rows(x)
    assert got.values.shape == x.shape and got.scale.shape == (18, 1)
    assert_same_rows(got, expected, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rotary", [(7, 24, 12), (3, 128, 96)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_qk_norm_rope_writes_fp8_heads_with_a_bound_scale(heads, head_dim, rotary, heads_first, dtype):
    batch = 2
    q, k, wq, wk, cos, sin = qk_inputs(heads, head_dim, rotary, dtype, seed=14, batch=batch)
    wq[3] = 6.0  # one channel whose weight dominates, as trained norms have: the bound must hold, values stay normal
    got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, fp8=True)
    expected = rope_ref.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, fp8=True)
    dense = rope_ref.qk_norm_rope(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first)
    for (values, descale), (ref_values, ref_descale), exact, weight in zip(got, expected, dense, (wq, wk)):
        assert descale.shape == (batch, heads) and torch.equal(descale, ref_descale)
        assert torch.allclose(descale, rope_ref.fp8_scale(weight).expand(batch, heads))
        assert (exact / descale[0, 0]).abs().max() <= 448  # the bound: nothing saturates
        assert_same_fp8(values, ref_values)
        assert _err(_dequantized(values, ref_values) * descale[0, 0], exact.reshape(-1, head_dim)) < 0.05


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


def test_fp8_attention_takes_descaled_inputs():
    g = _case(16)
    q, k, v = (_rand(2, 40, 3, 16, dtype=torch.float32, generator=g, scale=s) for s in (0.5, 2.0, 30.0))
    exact = attention(q, k, v, backend="math")
    got = fp8_attention(quant_ref.quantize_heads(q), quant_ref.quantize_heads(k), quant_ref.quantize_heads(v),
                        out_dtype=torch.float32)
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert 1e-4 < _err(got, exact) < 0.08  # quantized for real, scales applied per (batch, head)
