"""MXFP4: the format against a float64 scalar reading of the OCP MX spec, MXFP4Linear, the Triton GEMM under the
interpreter, online quantization at load (bounded memory), save/load, and the tiny pipeline's quality."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h3gen.kernels.mxfp4_gemm import reference as gemm_ref  # noqa: E402
from h3gen.kernels.mxfp4_gemm import gluon as gemm_gluon  # noqa: E402
from h3gen.kernels.mxfp4_gemm import triton as gemm_triton  # noqa: E402
from h3gen.quant.mxfp4 import MXFP4Linear  # noqa: E402
from h3gen.quant.mxfp4_format import E2M1_VALUES, dequantize, quantize  # noqa: E402


def _spec_codes(row: list[float]) -> tuple[list[int], int]:
    """One 32-value block by the spec, in float64 scalars: (E2M1 codes, E8M0 scale byte)."""
    if any(not math.isfinite(v) for v in row):
        return [0] * len(row), 255
    amax = max(abs(v) for v in row)
    exponent = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
    codes = []
    for v in row:
        scaled = min(abs(v) / 2.0**exponent, 6.0)
        best = min(range(8), key=lambda c: (abs(E2M1_VALUES[c] - scaled), c % 2))  # nearest, ties to even
        codes.append(best | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, exponent + 127


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def test_quantize_matches_the_spec_on_random_and_special_blocks():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, generator=g) * 10 ** torch.empty(1).uniform_(-3, 3, generator=g) for _ in range(6)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 8) * 4  # ties and saturation, amax 28
    special = torch.zeros(64)
    special[32:] = torch.tensor([1e-40, -1e-42, 6.0, -0.0] + [0.0] * 28)
    weight = torch.stack([*rows, ties, special])
    packed, scales = quantize(weight)
    codes = _unpack(packed)
    for r in range(weight.shape[0]):
        for b in range(2):
            expected_codes, expected_scale = _spec_codes(weight[r, 32 * b : 32 * (b + 1)].double().tolist())
            assert codes[r, 32 * b : 32 * (b + 1)].tolist() == expected_codes, (r, b)
            assert scales[r, b].item() == expected_scale, (r, b)
    restored = dequantize(packed, scales)
    assert restored[-1, :32].abs().sum() == 0 and scales[-1, 0] == 0  # a zero block
    assert restored[-1, 34] == 6.0 * 2.0**-2 * 4  # the largest value of its block comes back exactly
    # Ties go to the even code and 7 x scale saturates at 6 x scale (scale 4 here: amax 28 -> 2^(4 - 2)).
    assert restored[-2, :8].tolist() == [0.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 24.0]


def test_round_trip_error_and_exact_values():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 96, generator=g)
    restored = dequantize(*quantize(weight))
    error = ((restored - weight).norm() / weight.norm()).item()
    assert 0.05 < error < 0.2  # E2M1 keeps one mantissa bit
    exact = torch.tensor([[0.5, -1.5, 3.0, 6.0] * 8])  # representable values survive exactly
    assert torch.equal(dequantize(*quantize(exact)), exact)


def test_nan_and_inf_make_the_block_nan():
    weight = torch.ones(2, 64)
    weight[0, 5] = float("nan")
    weight[1, 40] = float("inf")
    packed, scales = quantize(weight)
    assert scales.tolist() == [[255, 125], [125, 255]]
    restored = dequantize(packed, scales)
    assert torch.isnan(restored[0, :32]).all() and torch.isfinite(restored[0, 32:]).all()
    assert torch.isnan(restored[1, 32:]).all() and torch.isfinite(restored[1, :32]).all()


def test_odd_width_is_padded_and_linear_matches_dequantized_weight():
    linear = torch.nn.Linear(70, 37)
    layer = MXFP4Linear.from_linear(linear)
    assert layer.weight_packed.shape == (37, 48) and layer.weight_scale.shape == (37, 3)
    x = torch.randn(3, 5, 70)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), linear.bias)
    assert torch.allclose(layer(x), expected, atol=1e-5)


@pytest.mark.parametrize("m,n,k,dtype,config", [
    (5, 37, 70, torch.float32, dict(block_m=16, block_n=16, block_k=32)),
    (33, 64, 96, torch.float16, dict(block_m=16, block_n=32, block_k=64)),
    (1, 17, 32, torch.float32, dict(block_m=16, block_n=16, block_k=32)),
    (17, 9, 160, torch.float16, dict(block_m=32, block_n=16, block_k=32)),
    (3, 40, 200, torch.float32, dict(block_m=16, block_n=32, block_k=64, split_k=3)),  # K slices summed atomically
    (7, 50, 130, torch.float16, dict(block_m=16, block_n=32, block_k=64, swap_ab=True)),  # transposed product
    (4, 64, 256, torch.float32, dict(block_m=16, block_n=16, block_k=64, swap_ab=True, split_k=2)),
    (2, 33, 96, torch.float16, {}),  # the default small-M tiles: one 256-wide K tile covers all of K
    (70, 24, 65, torch.float32, {}),  # the default mid-M tiles
    # The tensor-core few-row path (its tiling, masks and K permutation; on the CPU through its Triton decode, the
    # inline PTX decode is checked on the GPU below): default tiles, the last K tile past the stored width
    (3, 40, 200, torch.float32, dict(path="pairs")),
    (16, 70, 256, torch.float16, dict(path="pairs", block_n=32, block_k=64, split_k=2)),  # K slices, atomically
    (5, 33, 104, torch.float32, dict(path="pairs", block_n=16, block_k=32, split_k=1)),  # odd N, one slice
])
def test_triton_gemm_matches_reference(m, n, k, dtype, config):
    g = torch.Generator().manual_seed(m * n)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scales = (t.to(device) for t in quantize(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(device, dtype)
    got = gemm_triton.mxfp4_matmul(x, packed, scales, **{"path": "fused", **config})
    expected = gemm_ref.mxfp4_matmul(x, packed, scales)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < tolerance


@pytest.mark.parametrize("n,k,config", [(37, 70, dict(block_n=16, block_k=32)), (64, 300, dict(block_n=32, block_k=64)),
                                        (20, 256, dict(block_n=16, block_k=64, split_k=2))])
def test_triton_gemv_matches_reference(n, k, config):
    g = torch.Generator().manual_seed(n + k)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scales = (t.to(device) for t in quantize(torch.randn(n, k, generator=g)))
    x = torch.randn(1, k, generator=g).to(device)
    got = gemm_triton.mxfp4_matmul(x, packed, scales, path="gemv", **config)
    expected = gemm_ref.mxfp4_matmul(x, packed, scales)
    assert got.shape == (1, n) and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="one row"):
        gemm_triton.mxfp4_matmul(torch.randn(2, k, device=device), packed, scales, path="gemv")


@pytest.mark.parametrize("m,n,k,dtype,config", [
    (1, 37, 70, torch.float16, dict(block_n=16, block_k=32)),  # odd N and K: stored width padded to 96
    (5, 64, 300, torch.bfloat16, dict(block_n=32, block_k=64, split_k=2)),  # K slices summed atomically
    (17, 40, 256, torch.float16, dict(block_m=16, block_n=16, block_k=128)),  # two row tiles
    (3, 33, 96, torch.bfloat16, {}),  # default tiles: one K tile wider than K
])
def test_scaled_dot_gemm_matches_reference(m, n, k, dtype, config):
    g = torch.Generator().manual_seed(m + n + k)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed, scales = (t.to(device) for t in quantize(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(device, dtype)
    got = gemm_triton.mxfp4_matmul(x, packed, scales, path="scaled", **config)
    expected = gemm_ref.mxfp4_matmul(x.float(), packed, scales)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3  # one rounding of the output
    assert ((got.float() - expected).norm() / expected.norm()).item() < tolerance
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemm_triton.mxfp4_matmul(x.float(), packed, scales, path="scaled")


def test_pair_gemm_rejects_k_not_a_multiple_of_8():
    packed, scales = quantize(torch.randn(8, 100))
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm_triton.mxfp4_matmul(torch.randn(2, 100), packed, scales, path="pairs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the inline PTX decode runs on a GPU only")
def test_pair_gemm_ptx_decode_every_code_and_special_scales():
    g = torch.Generator().manual_seed(11)
    n, k = 48, 1024
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8) * 2 + 1  # every code in both nibbles
    scales = torch.randint(100, 140, (n, k // 32), dtype=torch.uint8, generator=g)
    scales[1] = torch.tensor([0, 1, 2, 127, 128, 129, 200, 254] * 4, dtype=torch.uint8)  # smallest to largest
    scales[2, 3] = 255  # NaN: row 2's outputs are NaN
    packed, scales = packed.cuda(), scales.cuda()
    weight = dequantize(packed, scales, torch.float32, k).to(torch.bfloat16).double()
    for m in (2, 7, 16):
        x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
        got = gemm_triton.mxfp4_matmul(x, packed, scales, path="pairs").double()
        expected = x.double() @ weight.t()
        assert torch.equal(got.isnan(), expected.isnan()) and got[:, 2].isnan().all()
        finite = expected.isfinite()
        assert torch.equal(got.isinf(), expected.isinf())
        error = (got[finite] - expected[finite]).norm() / expected[finite].norm()
        assert error.item() < 4e-3  # the output's bf16 rounding

def test_gluon_decode_bit_arithmetic_gives_every_code_in_mma_order():
    """The few-row kernel's PTX decode, replayed in torch integers: word bytes b0..b3 -> (low codes of b0, b1),
    (low of b2, b3), (high of b0, b1), (high of b2, b3), each half the bf16 bits of E2M1 * 2^-126."""
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=g)
    words[:256] = torch.arange(256) * 0x01010101  # every byte in every position
    outputs = gemm_gluon.decode_words_reference(words)
    byte = [(words >> (8 * i)) & 0xFF for i in range(4)]
    codes = [(byte[0] & 15, byte[1] & 15), (byte[2] & 15, byte[3] & 15), (byte[0] >> 4, byte[1] >> 4),
             (byte[2] >> 4, byte[3] >> 4)]
    table = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float64)
    for pair, (first, second) in zip(outputs, codes):
        for half, code in ((pair & 0xFFFF, first), (pair >> 16, second)):
            value = half.to(torch.int32).to(torch.int16).view(torch.bfloat16).double() * 2.0**126
            assert torch.equal(value, table[code]), "decoded value or element order differs"


def test_gluon_folded_scale_is_exact_up_to_128_and_refused_above():
    """With the scale folded into the decode, a code's bf16 bits (E2M1 * 2^-126) times the bf16 2^(e-1) must be
    the exact dequantized value for every code and every E8M0 byte the fold accepts (0-128, and 255 as NaN), and
    not for 129 (2^128 is not a bf16 number), which `foldable` therefore refuses."""
    codes = torch.arange(16, dtype=torch.int64)
    words = codes | (codes << 4)  # byte b0 = (code, code); the other bytes zero
    decoded = gemm_gluon.decode_words_reference(words)[0] & 0xFFFF  # the low code of b0
    halves = decoded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    table = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float64)
    for e in list(range(129)) + [255]:
        scale = gemm_gluon.folded_scale_bits(torch.tensor(e)).to(torch.int16).view(torch.bfloat16)
        got = (halves * scale).double()
        if e == 255:
            assert got.isnan().all()
        else:
            assert torch.equal(got, table * 2.0 ** (e - 127)), f"scale byte {e}"
    too_large = gemm_gluon.folded_scale_bits(torch.tensor(129)).to(torch.int16).view(torch.bfloat16)
    assert (halves[1:8] * too_large).double().isinf().all()
    scales = torch.tensor([[0, 1, 127, 128, 255]], dtype=torch.uint8)
    assert gemm_gluon.foldable(scales)
    scales[0, 1] = 129  # written in place: the cached answer is not reused
    assert not gemm_gluon.foldable(scales)
    assert gemm_gluon.foldable(quantize(torch.randn(64, 256))[1])  # weights of ordinary size fold
    assert not gemm_gluon.foldable(quantize(torch.randn(64, 256) * 100)[1])  # blocks beyond 12 in size do not


@pytest.mark.skipif(not gemm_gluon.HAS_TMA, reason="this Triton has no Gluon TMA")
def test_gluon_ring_descriptor_reads_the_packed_words_and_lets_them_go():
    import gc
    import weakref

    whole = torch.randint(0, 256, (48, 320), dtype=torch.uint8)
    packed = whole[:, 64:]  # a column slice: rows 320 bytes apart, 16-byte aligned
    descriptor = gemm_gluon._words_descriptor(packed, 32)
    assert torch.equal(descriptor.base, packed.view(torch.int32)) and descriptor.base.data_ptr() == packed.data_ptr()
    assert descriptor.shape == [48, 64] and descriptor.strides == [80, 1] and descriptor.block_shape == [32, 16]
    assert gemm_gluon._words_descriptor(packed, 32) is descriptor  # kept while `packed` lives
    alive = weakref.ref(packed)
    del packed, descriptor, whole
    gc.collect()
    assert alive() is None  # the cached descriptor does not keep the weight alive


def test_gluon_plan_divides_k_and_fills_the_gpu():
    for m, n, k in [(1, 7168, 5376), (16, 7168, 5376), (8, 28672, 5376), (1, 5376, 14336), (4, 2048, 2048),
                    (1, 200, 384), (9, 1536, 768)]:
        block_n, warps, splits = gemm_gluon.plan(m, n, k, sms=132)
        steps = k // gemm_gluon.BLOCK_K
        assert steps % splits == 0 and block_n in (32, 64, 128) and warps * 16 <= block_n
        default = 128 if m <= 8 else 64
        assert block_n == default or -(-n // (2 * block_n)) * steps < 264  # narrower only for small weights
        assert -(-n // block_n) * splits >= 264 or splits == steps  # at least two programs per SM when possible
    assert gemm_gluon.plan(1, 7168, 5376, sms=132) == (128, 4, 7)  # the H200's best tile for this shape
    assert gemm_gluon.plan(1, 7168, 5376, sms=132, ring=True) == (64, 2, 7)  # and through the TMA ring


def test_gluon_path_declines_what_it_cannot_run(monkeypatch):
    packed, scales = quantize(torch.randn(64, 256))
    assert not gemm_gluon.supports(torch.randn(2, 256, dtype=torch.bfloat16), packed, scales)  # a CPU tensor
    if torch.cuda.is_available():
        packed, scales = packed.cuda(), scales.cuda()
        x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
        assert gemm_gluon.supports(x, packed, scales) == gemm_gluon.AVAILABLE
        monkeypatch.setenv("H3GEN_GLUON", "0")
        assert not gemm_gluon.supports(x, packed, scales)  # the switch back to the Triton paths
        monkeypatch.delenv("H3GEN_GLUON")
        assert not gemm_gluon.supports(x.half(), packed, scales)  # fp16 takes the scaled dot
        assert not gemm_gluon.supports(torch.randn(17, 256, device="cuda", dtype=torch.bfloat16), packed, scales)
        odd_packed, odd_scales = quantize(torch.randn(64, 160, device="cuda"))
        assert not gemm_gluon.supports(torch.randn(2, 160, device="cuda", dtype=torch.bfloat16), odd_packed,
                                       odd_scales)  # K not a multiple of 128
    with pytest.raises(ValueError, match="1-16 rows of bf16"):
        gemm_gluon.few_rows_matmul(torch.randn(2, 256), packed.cpu(), scales.cpu())


@pytest.mark.skipif(not (torch.cuda.is_available() and gemm_gluon.AVAILABLE), reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("n,k,splits", [(200, 1024, None), (200, 1024, 1), (200, 1024, 8), (48, 384, None),
                                        (1536, 768, None)])
@pytest.mark.parametrize("ring", [False, True], ids=["registers", "tma-ring"])
@pytest.mark.parametrize("folding", [False, True], ids=["scales-up-to-254", "scales-that-fold"])
def test_gluon_few_rows_every_code_special_scales_and_tails(n, k, splits, ring, folding, monkeypatch):
    g = torch.Generator().manual_seed(13)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8) * 2 + 1  # every code in both nibbles
    scales = torch.randint(100, 129 if folding else 140, (n, k // 32), dtype=torch.uint8, generator=g)
    special = [0, 1, 2, 126, 127, 128] if folding else [0, 1, 2, 127, 128, 129, 200, 254]  # smallest to largest
    scales[1, :len(special)] = torch.tensor(special, dtype=torch.uint8)
    scales[2, 3] = 255  # NaN: row 2's outputs are NaN
    packed, scales = packed.cuda(), scales.cuda()
    if ring and not gemm_gluon.uses_ring(packed):
        pytest.skip("the TMA ring needs a Hopper GPU")
    assert gemm_gluon.foldable(scales) == folding
    weight = dequantize(packed, scales, torch.float32, k).to(torch.bfloat16).double()
    calls = []
    monkeypatch.setattr(gemm_gluon, "few_rows_matmul",
                        lambda *a, _real=gemm_gluon.few_rows_matmul, **kw: calls.append(1) or _real(*a, **kw))
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
        expected = x.double() @ weight.t()
        finite = expected.isfinite()
        # the explicit call, and `mxfp4_matmul`'s automatic choice (which must be this path)
        for got in (gemm_gluon.few_rows_matmul(x, packed, scales, splits=splits, ring=ring).double(),
                    gemm_triton.mxfp4_matmul(x, packed, scales).double()):
            assert torch.equal(got.isnan(), expected.isnan()) and got[:, 2].isnan().all()
            assert torch.equal(got.isinf(), expected.isinf())
            error = (got[finite] - expected[finite]).norm() / expected[finite].norm()
            assert error.item() < 4e-3  # the output's bf16 rounding
    assert len(calls) == 10
    assert not gemm_gluon._WORKSPACES[torch.device("cuda", torch.cuda.current_device())].any()  # left at zero


@pytest.mark.skipif(not (torch.cuda.is_available() and gemm_gluon.AVAILABLE), reason="Gluon kernels run on a GPU only")
def test_gluon_few_rows_replays_in_a_cuda_graph():
    packed, scales = quantize(torch.randn(640, 1280, device="cuda"))
    static_x = torch.randn(5, 1280, device="cuda", dtype=torch.bfloat16)
    gemm_gluon.few_rows_matmul(static_x, packed, scales)  # compile outside the capture
    unchecked = scales.clone()  # first seen during the capture, where `foldable` may not synchronize
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gemm_gluon.few_rows_matmul(static_x, packed, scales)
        static_unchecked = gemm_gluon.few_rows_matmul(static_x, packed, unchecked)
    for seed in range(3):
        x = torch.randn(5, 1280, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
        static_x.copy_(x)
        graph.replay()
        eager = gemm_gluon.few_rows_matmul(x, packed, scales)
        # K slices add into the workspace in whichever order they finish: a float32 sum's last bit may differ,
        # and with it, rarely, the bf16 rounding of an output
        for got in (static_out, static_unchecked):
            torch.testing.assert_close(got, eager, rtol=2**-7, atol=0)
            assert (got != eager).float().mean().item() < 0.01


def test_triton_dequantize_matches_reference_including_special_scales():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 100, generator=g) * torch.logspace(-30, 30, 37)[:, None]
    weight[5, 40] = float("nan")  # its whole 32-block (elements 32..63) decodes to NaN
    packed, scales = quantize(weight)
    packed[7], scales[7, 0] = 0xFF, 0  # the smallest scale and the largest magnitude codes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = gemm_triton.dequantize(packed.to(device), scales.to(device), torch.float32, 100).cpu()
    expected = dequantize(packed, scales, torch.float32, 100)
    assert torch.equal(got.isnan(), expected.isnan()) and got[5, 32:64].isnan().all()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))
    x = torch.randn(4, 100, generator=g)
    product = gemm_triton.mxfp4_matmul(x.to(device), packed[:4].to(device), scales[:4].to(device), path="dequant")
    assert torch.allclose(product.cpu(), gemm_ref.mxfp4_matmul(x, packed[:4], scales[:4]), rtol=1e-5, atol=0)


def test_saved_quantized_checkpoint_round_trips(tmp_path):
    from h3_tiny import TINY_CONFIGS, random_inputs, randomize_

    from h3gen.pipelines.h3.transformer import H3Transformer

    full = H3Transformer.from_config(TINY_CONFIGS[0]).eval()
    randomize_(full, seed=2)
    full.save_pretrained(tmp_path / "bf16")
    quantized = H3Transformer.from_pretrained(tmp_path / "bf16", torch_dtype=torch.float32, quantization="mxfp4")
    assert isinstance(quantized.transformer_blocks[0].adaln_proj.linear, MXFP4Linear)
    assert not isinstance(quantized.proj_in, MXFP4Linear)  # float32 islands stay dense
    quantized.save_pretrained(tmp_path / "mxfp4")
    reloaded = H3Transformer.from_pretrained(tmp_path / "mxfp4", torch_dtype=torch.float32)
    assert reloaded.quantization == "mxfp4"
    inputs = random_inputs(TINY_CONFIGS[0], seed=3, num_text=5, latent_frames=2, latent_hw=(4, 2), audio_latents=3)
    with torch.no_grad():
        a, b, ref = (model(**inputs, return_dict=False)[0] for model in (quantized, reloaded, full))
    assert torch.equal(a, b)
    assert 1e-3 < ((a - ref).norm() / ref.norm()).item() < 0.5  # quantized, and still close


ONLINE = r"""
import sys, threading, time, torch
from h3gen.pipelines.h3.transformer import H3Transformer

def anon():  # private memory only: the checkpoint's mmapped pages are file-backed and not counted
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak, done = [anon()], threading.Event()
base = peak[0]
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
thread = threading.Thread(target=sample)
thread.start()
model = H3Transformer.from_pretrained(sys.argv[1], torch_dtype=torch.float32, quantization="mxfp4")
done.set()
thread.join()
kept = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
print(peak[0] - base, kept)
"""


def test_online_quantization_peak_memory_is_about_one_layer(tmp_path):
    from h3gen.pipelines.h3.transformer import H3Transformer

    config = dict(num_attention_heads=4, attention_head_dim=128, hidden_size=512, num_layers=8, num_refiner_layers=1,
                  ffn_dim=2048, text_dim=64, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=64,
                  rope_freq_dim=16)
    model = H3Transformer.from_config(config)
    model.save_pretrained(tmp_path, max_shard_bytes=64 * 2**20)
    checkpoint = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    largest = max(p.numel() for p in model.parameters()) * 8  # the float64 working copy of the largest tensor
    del model
    # glibc would otherwise serve these tensors from its heap and keep freed pages, so the resident size would show
    # its high-water mark rather than the memory actually live; with mmap for large blocks, freed means returned.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    result = subprocess.run([sys.executable, "-c", ONLINE, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    grown, kept = (int(v) for v in result.stdout.strip().splitlines()[-1].split())
    print(f"online MXFP4 load: checkpoint {checkpoint / 2**20:.0f} MiB, model kept {kept / 2**20:.0f} MiB, "
          f"peak private growth {grown / 2**20:.0f} MiB")
    # The packed model plus one tensor in flight (and allocator slack), never the full-precision checkpoint.
    assert kept < checkpoint / 4
    assert grown < kept + 2 * largest + 48 * 2**20 and grown < checkpoint * 0.6


def test_tiny_pipeline_quality_under_mxfp4(tmp_path):
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    folder = tiny_checkpoint(cache_dir=tmp_path)
    kwargs = dict(seed=1, num_inference_steps=4)
    plain = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)("a cat", **kwargs)
    quant = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32, quantization="mxfp4")(
        "a cat", **kwargs)
    video_error = np.linalg.norm(quant.video - plain.video) / np.linalg.norm(plain.video)
    audio_error = np.linalg.norm(quant.audio - plain.audio) / np.linalg.norm(plain.audio)
    print(f"tiny pipeline mxfp4 vs fp32: video rel L2 {video_error:.2e}, audio rel L2 {audio_error:.2e}")
    assert 0 < video_error < 0.2 and 0 <= audio_error < 0.2
