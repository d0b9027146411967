"""The MXFP4-weight GEMM paths (fused, GEMV, scaled dot, pairs, Gluon few-row, dequantize) against the reference,
which is a plain dequantize + matmul. Gluon and the inline PTX decode run on a GPU only."""

import pytest
import torch
from helpers.kernel_cases import DEVICE

from h3gen.kernels.mxfp4_gemm import gluon as gemm_gluon
from h3gen.kernels.mxfp4_gemm import gluon_kernels, triton_decode
from h3gen.kernels.mxfp4_gemm import reference as gemm_ref
from h3gen.kernels.mxfp4_gemm import triton as gemm_triton
from h3gen.quant.mxfp4_format import E2M1_VALUES, dequantize, quantize


def _decode_words(words: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the Gluon kernel's `DECODE` (`ptx.WIDEN_CODES`) computes, replayed in torch integers: int64 words `[...]`
    holding 32-bit values -> four int64 tensors of bf16 bit pairs (low half = first element), before the final
    * 2^126."""
    t = (words & 0xFF) | (((words >> 16) & 0xFF) << 8) | (((words >> 8) & 0xFF) << 16) | (((words >> 24) & 0xFF) << 24)
    u = t >> 8
    mask = 0x81C081C0
    a = (((t & 0x000F000F) * 4160) & 0xFFFFFFFF) & mask
    b = (((u & 0x000F000F) * 4160) & 0xFFFFFFFF) & mask
    c = (((t & 0x00F000F0) * 260) & 0xFFFFFFFF) & mask
    d = (((u & 0x00F000F0) * 260) & 0xFFFFFFFF) & mask
    return a, b, c, d


def _folded_scale_bits(scale_bytes: torch.Tensor) -> torch.Tensor:
    """What the Gluon kernel multiplies a word's decoded codes by when the scales are folded (`DECODE_SCALED`):
    E8M0 bytes -> int32 bf16 bits of 2^(e-1) (NaN for 255)."""
    e = scale_bytes.to(torch.int32)
    return torch.where(e == 255, 0x7FC0, (e + 126) << 7)


@pytest.mark.parametrize(
    "m,n,k,dtype,config",
    [
        (5, 37, 70, torch.float32, dict(block_m=16, block_n=16, block_k=32)),
        (1, 17, 32, torch.float32, dict(block_m=16, block_n=16, block_k=32)),
        (3, 40, 200, torch.float32, dict(block_m=16, block_n=32, block_k=64, split_k=3)),  # K slices summed atomically
        (7, 50, 130, torch.float16, dict(block_m=16, block_n=32, block_k=64)),
        (4, 64, 256, torch.float32, dict(block_m=16, block_n=16, block_k=64, split_k=2)),
        (2, 33, 96, torch.float16, {}),  # the default small-M tiles: one 256-wide K tile covers all of K
        # The tensor-core few-row path (its tiling, masks and K permutation; on the CPU through its Triton decode, the
        # inline PTX decode is checked on the GPU below): default tiles, the last K tile past the stored width
        (3, 40, 200, torch.float32, dict(path="pairs")),
        (16, 70, 256, torch.float16, dict(path="pairs", block_n=32, block_k=64, split_k=2)),  # K slices, atomically
        (5, 33, 104, torch.float32, dict(path="pairs", block_n=16, block_k=32, split_k=1)),  # odd N, one slice
    ],
)
def test_triton_gemm_matches_reference(m, n, k, dtype, config):
    g = torch.Generator().manual_seed(m * n)
    device = DEVICE
    packed, scales = (t.to(device) for t in quantize(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(device, dtype)
    got = gemm_triton.mxfp4_matmul(x, packed, scales, **{"path": "fused", **config})
    expected = gemm_ref.mxfp4_matmul(x, packed, scales)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < tolerance


@pytest.mark.parametrize(
    "n,k,config",
    [
        (37, 70, dict(block_n=16, block_k=32)),
        (64, 300, dict(block_n=32, block_k=64)),
        (20, 256, dict(block_n=16, block_k=64, split_k=2)),
    ],
)
def test_triton_gemv_matches_reference(n, k, config):
    g = torch.Generator().manual_seed(n + k)
    device = DEVICE
    packed, scales = (t.to(device) for t in quantize(torch.randn(n, k, generator=g)))
    x = torch.randn(1, k, generator=g).to(device)
    got = gemm_triton.mxfp4_matmul(x, packed, scales, path="gemv", **config)
    expected = gemm_ref.mxfp4_matmul(x, packed, scales)
    assert got.shape == (1, n) and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="one row"):
        gemm_triton.mxfp4_matmul(torch.randn(2, k, device=device), packed, scales, path="gemv")


@pytest.mark.parametrize(
    "m,n,k,dtype,config",
    [
        (1, 37, 70, torch.float16, dict(block_n=16, block_k=32)),  # odd N and K: stored width padded to 96
        (5, 64, 300, torch.bfloat16, dict(block_n=32, block_k=64, split_k=2)),  # K slices summed atomically
        (3, 33, 96, torch.bfloat16, {}),  # default tiles: one K tile wider than K
    ],
)
def test_scaled_dot_gemm_matches_reference(m, n, k, dtype, config):
    g = torch.Generator().manual_seed(m + n + k)
    device = DEVICE
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
    outputs = _decode_words(words)
    byte = [(words >> (8 * i)) & 0xFF for i in range(4)]
    codes = [
        (byte[0] & 15, byte[1] & 15),
        (byte[2] & 15, byte[3] & 15),
        (byte[0] >> 4, byte[1] >> 4),
        (byte[2] >> 4, byte[3] >> 4),
    ]
    table = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float64)
    for pair, (first, second) in zip(outputs, codes, strict=True):
        for half, code in ((pair & 0xFFFF, first), (pair >> 16, second)):
            value = half.to(torch.int32).to(torch.int16).view(torch.bfloat16).double() * 2.0**126
            assert torch.equal(value, table[code]), "decoded value or element order differs"


def test_gluon_folded_scale_is_exact_up_to_128_and_refused_above():
    """With the scale folded into the decode, a code's bf16 bits (E2M1 * 2^-126) times the bf16 2^(e-1) must be
    the exact dequantized value for every code and every E8M0 byte the fold accepts (0-128, and 255 as NaN), and
    not for 129 (2^128 is not a bf16 number), which `foldable` therefore refuses."""
    codes = torch.arange(16, dtype=torch.int64)
    words = codes | (codes << 4)  # byte b0 = (code, code); the other bytes zero
    decoded = _decode_words(words)[0] & 0xFFFF  # the low code of b0
    halves = decoded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    table = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float64)
    for e in list(range(129)) + [255]:
        scale = _folded_scale_bits(torch.tensor(e)).to(torch.int16).view(torch.bfloat16)
        got = (halves * scale).double()
        if e == 255:
            assert got.isnan().all()
        else:
            assert torch.equal(got, table * 2.0 ** (e - 127)), f"scale byte {e}"
    too_large = _folded_scale_bits(torch.tensor(129)).to(torch.int16).view(torch.bfloat16)
    assert (halves[1:8] * too_large).double().isinf().all()
    scales = torch.tensor([[0, 1, 127, 128, 255]], dtype=torch.uint8)
    assert gemm_gluon.foldable(scales)
    scales[0, 1] = 129  # written in place: the cached answer is not reused
    assert not gemm_gluon.foldable(scales)
    assert gemm_gluon.foldable(quantize(torch.randn(64, 256))[1])  # weights of ordinary size fold
    assert not gemm_gluon.foldable(quantize(torch.randn(64, 256) * 100)[1])  # blocks beyond 12 in size do not


@pytest.mark.skipif(not gluon_kernels.HAS_TMA, reason="this Triton has no Gluon TMA")
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
    for m, n, k in [
        (1, 7168, 5376),
        (16, 7168, 5376),
        (8, 28672, 5376),
        (1, 5376, 14336),
        (4, 2048, 2048),
        (1, 200, 384),
        (9, 1536, 768),
    ]:
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
        assert gemm_gluon.supports(x, packed, scales) == gluon_kernels.AVAILABLE
        monkeypatch.setenv("H3GEN_GLUON", "0")
        assert not gemm_gluon.supports(x, packed, scales)  # the switch back to the Triton paths
        monkeypatch.delenv("H3GEN_GLUON")
        assert not gemm_gluon.supports(x.half(), packed, scales)  # fp16 takes the scaled dot
        assert not gemm_gluon.supports(torch.randn(17, 256, device="cuda", dtype=torch.bfloat16), packed, scales)
        odd_packed, odd_scales = quantize(torch.randn(64, 160, device="cuda"))
        assert not gemm_gluon.supports(
            torch.randn(2, 160, device="cuda", dtype=torch.bfloat16), odd_packed, odd_scales
        )  # K not a multiple of 128
    with pytest.raises(ValueError, match="1-16 rows of bf16"):
        gemm_gluon.few_rows_matmul(torch.randn(2, 256), packed.cpu(), scales.cpu())


@pytest.mark.skipif(
    not (torch.cuda.is_available() and gluon_kernels.AVAILABLE), reason="Gluon kernels run on a GPU only"
)
@pytest.mark.parametrize(
    "n,k,splits", [(200, 1024, None), (200, 1024, 1), (200, 1024, 8), (48, 384, None), (1536, 768, None)]
)
@pytest.mark.parametrize("ring", [False, True], ids=["registers", "tma-ring"])
@pytest.mark.parametrize("folding", [False, True], ids=["scales-up-to-254", "scales-that-fold"])
def test_gluon_few_rows_every_code_special_scales_and_tails(n, k, splits, ring, folding, monkeypatch):
    g = torch.Generator().manual_seed(13)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8) * 2 + 1  # every code in both nibbles
    scales = torch.randint(100, 129 if folding else 140, (n, k // 32), dtype=torch.uint8, generator=g)
    special = [0, 1, 2, 126, 127, 128] if folding else [0, 1, 2, 127, 128, 129, 200, 254]  # smallest to largest
    scales[1, : len(special)] = torch.tensor(special, dtype=torch.uint8)
    scales[2, 3] = 255  # NaN: row 2's outputs are NaN
    packed, scales = packed.cuda(), scales.cuda()
    if ring and not gemm_gluon.uses_ring(packed):
        pytest.skip("the TMA ring needs a Hopper GPU")
    assert gemm_gluon.foldable(scales) == folding
    weight = dequantize(packed, scales, torch.float32, k).to(torch.bfloat16).double()
    calls = []
    monkeypatch.setattr(
        gemm_gluon,
        "few_rows_matmul",
        lambda *a, _real=gemm_gluon.few_rows_matmul, **kw: calls.append(1) or _real(*a, **kw),
    )
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
        expected = x.double() @ weight.t()
        finite = expected.isfinite()
        # the explicit call, and `mxfp4_matmul`'s automatic choice (which must be this path)
        for got in (
            gemm_gluon.few_rows_matmul(x, packed, scales, splits=splits, ring=ring).double(),
            gemm_triton.mxfp4_matmul(x, packed, scales).double(),
        ):
            assert torch.equal(got.isnan(), expected.isnan()) and got[:, 2].isnan().all()
            assert torch.equal(got.isinf(), expected.isinf())
            error = (got[finite] - expected[finite]).norm() / expected[finite].norm()
            assert error.item() < 4e-3  # the output's bf16 rounding
    assert len(calls) == 10
    assert not gemm_gluon._WORKSPACES[torch.device("cuda", torch.cuda.current_device())].any()  # left at zero


@pytest.mark.skipif(
    not (torch.cuda.is_available() and gluon_kernels.AVAILABLE), reason="Gluon kernels run on a GPU only"
)
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
    device = DEVICE
    got = triton_decode.dequantize(packed.to(device), scales.to(device), torch.float32, 100).cpu()
    expected = dequantize(packed, scales, torch.float32, 100)
    assert torch.equal(got.isnan(), expected.isnan()) and got[5, 32:64].isnan().all()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))
    x = torch.randn(4, 100, generator=g)
    product = gemm_triton.mxfp4_matmul(x.to(device), packed[:4].to(device), scales[:4].to(device), path="dequant")
    assert torch.allclose(product.cpu(), gemm_ref.mxfp4_matmul(x, packed[:4], scales[:4]), rtol=1e-5, atol=0)
