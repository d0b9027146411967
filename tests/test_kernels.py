"""Every Triton kernel against its torch reference: on the CPU under TRITON_INTERPRET=1 in fp32/fp16 (the
interpreter gets bf16 wrong), on a GPU in bf16 and fp32. Odd sizes, fresh random inputs, relative errors."""

import pytest
import torch
from kernel_cases import (DEVICE, DTYPES, ON_GPU, SHAPES, case as _case, err as _err, half_block_inputs, qk_inputs,
                          rand as _rand)

from h3gen.kernels.gated_residual import reference as residual_ref  # noqa: E402
from h3gen.kernels.gated_residual import triton as residual_triton  # noqa: E402
from h3gen.kernels.norm_modulate import reference as norm_ref  # noqa: E402
from h3gen.kernels.norm_modulate import triton as norm_triton  # noqa: E402
from h3gen.kernels.qk_norm_rope import reference as rope_ref  # noqa: E402
from h3gen.kernels.qk_norm_rope import triton as rope_triton  # noqa: E402
from h3gen.kernels.swiglu import reference as swiglu_ref  # noqa: E402
from h3gen.kernels.swiglu import triton as swiglu_triton  # noqa: E402

# Reference and kernel round differently (the kernel rounds once, at the end): allow a few ulps of the dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_modulate_matches_reference(shape, dtype):
    g = _case(1)
    batch, seq, hidden = shape
    x, weight = _rand(*shape, dtype=dtype, generator=g), _rand(hidden, dtype=dtype, generator=g)
    table = _rand(7, 6 * hidden, dtype=dtype, generator=g)  # column slices of one table, as the model passes them
    shift, scale = table[:, :hidden], table[:, hidden : 2 * hidden]
    index = torch.randint(0, 7, (seq,), generator=g, device=DEVICE)
    got = norm_triton.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5)
    expected = norm_ref.rmsnorm_modulate(x.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert _err(got, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_residual_and_fused_norm_match_reference(shape, dtype):
    x, y, weight, gate, shift, scale, index = half_block_inputs(shape, dtype, seed=2)
    f32 = [t.float() for t in (x, y, gate)]
    assert _err(residual_triton.gated_residual(x, y, gate, index), residual_ref.gated_residual(*f32, index)) \
        <= TOLERANCE[dtype]
    x_new, modulated = residual_triton.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, 1e-5)
    ref_new, ref_mod = residual_ref.gated_residual_norm_modulate(*f32, index, weight.float(), shift.float(),
                                                                 scale.float(), 1e-5)
    assert _err(x_new, ref_new) <= TOLERANCE[dtype] and _err(modulated, ref_mod) <= 2 * TOLERANCE[dtype]
    in_place = x.clone()
    residual_triton.gated_residual(in_place, y, gate, index, out=in_place)
    assert torch.equal(in_place, residual_triton.gated_residual(x, y, gate, index))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rotary", [(7, 24, 12), (3, 128, 96), (5, 32, 32)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_qk_norm_rope_matches_reference(heads, head_dim, rotary, heads_first, dtype):
    q, k, wq, wk, cos, sin = qk_inputs(heads, head_dim, rotary, dtype, seed=3)
    expected = rope_ref.qk_norm_rope(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first)
    for per_program in (64, 2):  # all heads in one program, or groups of 2 (the last group partly masked)
        got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, heads_per_program=per_program)
        for a, b in zip(got, expected):
            assert a.shape == b.shape and a.dtype == dtype and a.is_contiguous()
            assert _err(a, b) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 13, 2 * 300), (2, 3, 2 * 1500), (4, 2 * 64)])
def test_swiglu_matches_reference(shape, dtype):
    x = _rand(*shape, dtype=dtype, generator=_case(4))
    got = swiglu_triton.swiglu(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert _err(got, swiglu_ref.swiglu(x.float())) <= TOLERANCE[dtype]


def test_public_functions_take_the_reference_on_cpu_tensors(monkeypatch):
    from h3gen.kernels import norm_modulate

    monkeypatch.delenv("H3GEN_TRITON", raising=False)
    if ON_GPU:
        pytest.skip("CPU dispatch only")
    x = torch.randn(1, 4, 8)
    table = torch.randn(2, 8)
    index = torch.tensor([0, 1, 1, 0])
    assert torch.equal(norm_modulate.rmsnorm_modulate(x, None, table, table, index, 1e-5),
                       norm_ref.rmsnorm_modulate(x, None, table, table, index, 1e-5))


@pytest.mark.skipif(not ON_GPU, reason="FP8 kernels need a GPU (the interpreter has no fp8)")
def test_fp8_kernels_on_gpu():
    from h3gen.kernels.fp8_quant import reference as quant_ref
    from h3gen.kernels.fp8_quant import triton as quant_triton

    g = _case(6)
    x = _rand(33, 14336, dtype=torch.bfloat16, generator=g)
    q, scale = quant_triton.quantize_rows(x)
    ref_q, ref_scale = quant_ref.quantize_rows(x)
    assert torch.allclose(scale, ref_scale) and (q.float() - ref_q.float()).abs().max() <= 32  # one e4m3 step
    assert _err(q.float() * scale, x.float()) < 0.05


def test_fp8_reference_quantization_roundtrip():
    from h3gen.kernels.fp8_quant.reference import quantize_rows

    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(7)) * torch.logspace(-3, 3, 9)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (9, 1)
    assert _err(q.float() * scale, x) < 0.05  # e4m3 keeps 3 mantissa bits: a few percent
