"""The attention dispatch: which backend "auto" picks for a device and the inputs, clear errors for a named
backend that cannot take them (FA3, cuDNN and flash take fp16/bf16 only), and the e4m3 path against torch's SDPA."""

import importlib

import pytest
import torch
from helpers.kernel_cases import case as _case
from helpers.kernel_cases import err as _err
from helpers.kernel_cases import rand as _rand

from h3gen.kernels.attention import attention, fp8_attention
from h3gen.kernels.fp8_quant import reference as quant_ref

dispatch = importlib.import_module("h3gen.kernels.attention")  # the module (the package exports its function)


@pytest.mark.parametrize(
    "device_type, major, dtype, head_dim, has_fa3, has_cudnn, expected",
    [
        ("cpu", 0, torch.bfloat16, 128, True, True, "sdpa"),
        ("cuda", 9, torch.bfloat16, 128, True, True, "fa3"),
        ("cuda", 9, torch.bfloat16, 32, True, True, "fa3"),
        ("cuda", 9, torch.float16, 64, True, True, "cudnn"),  # the fa3-fwd build refuses fp16
        ("cuda", 9, torch.bfloat16, 128, False, True, "cudnn"),
        ("cuda", 9, torch.float32, 128, True, True, "sdpa"),  # float32 on Hopper with FA3 installed: torch's choice
        ("cuda", 9, torch.float32, 128, False, True, "sdpa"),
        ("cuda", 9, torch.bfloat16, 192, False, True, "flash"),  # wider than cuDNN takes
        ("cuda", 9, torch.bfloat16, 36, True, True, "sdpa"),  # not a multiple of 8
        ("cuda", 9, torch.bfloat16, 512, True, True, "sdpa"),
        ("cuda", 10, torch.bfloat16, 128, True, True, "cudnn"),  # FA3 is a Hopper kernel
        ("cuda", 8, torch.float16, 64, True, True, "flash"),
        ("cuda", 7, torch.float16, 64, False, False, "sdpa"),
    ],
)
def test_auto_backend_fits_device_and_inputs(device_type, major, dtype, head_dim, has_fa3, has_cudnn, expected):
    assert dispatch._auto_backend(device_type, major, dtype, head_dim, has_fa3, has_cudnn) == expected


@pytest.mark.parametrize("backend", ["fa3", "cudnn", "flash"])
def test_named_half_only_backend_refuses_float32(monkeypatch, backend):
    monkeypatch.setattr(dispatch, "fa3_kernel", lambda: lambda *args, **kwargs: None)  # as if FA3 were installed
    with pytest.raises(ValueError, match="fp16 or bf16"):
        dispatch.resolve_backend(backend, torch.device("cpu"), torch.float32, 128)
    assert dispatch.resolve_backend(backend, torch.device("cpu"), torch.bfloat16, 128) == backend


def test_override_is_checked_like_a_named_backend(monkeypatch):
    monkeypatch.setenv("H3GEN_ATTENTION_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="'cudnn' takes fp16 or bf16"):
        dispatch.resolve_backend("auto", torch.device("cpu"), torch.float32, 64)


def test_auto_attention_in_float32_matches_the_math_backend():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 3, 24, generator=generator) for _ in range(3))
    expected = dispatch.attention(q, k, v, backend="math")
    torch.testing.assert_close(dispatch.attention(q, k, v, backend="auto"), expected)
    assert not torch.equal(expected, dispatch.attention(q, k.flip(1).roll(1, 2), v, backend="math"))


def test_fp8_attention_takes_descaled_inputs():
    g = _case(16)
    q, k, v = (_rand(2, 40, 3, 16, dtype=torch.float32, generator=g, scale=s) for s in (0.5, 2.0, 30.0))
    exact = attention(q, k, v, backend="math")
    got = fp8_attention(
        quant_ref.quantize_heads(q), quant_ref.quantize_heads(k), quant_ref.quantize_heads(v), out_dtype=torch.float32
    )
    assert got.shape == exact.shape and got.dtype == torch.float32
    # quantized for real, scales applied per (batch, head): measured 0.046 (e4m3's 3 mantissa bits); bounds half and
    # 1.5x that
    assert 0.023 < _err(got, exact) < 0.07
