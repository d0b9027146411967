"""MXFP4: the format against a float64 scalar reading of the OCP MX spec, MXFP4Linear, online quantization at
load (bounded memory), save/load, and the tiny pipeline's quality. The GEMM kernels:
tests/kernels/test_mxfp4_gemm.py."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from h3gen.quant.mxfp4 import MXFP4Linear
from h3gen.quant.mxfp4_format import E2M1_VALUES, dequantize, quantize


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
    assert 0.1 < error < 0.13  # E2M1 keeps one mantissa bit: measured 0.115 (exact float64 arithmetic); +-15 %
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


def test_saved_quantized_checkpoint_round_trips(tmp_path):
    from helpers.h3_tiny import TINY_CONFIGS, random_inputs, randomize_

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
    # quantized, and still close: measured 0.34 (random tiny weights amplify E2M1's error); bounds half and 1.3x
    assert 0.17 < ((a - ref).norm() / ref.norm()).item() < 0.45


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


@pytest.mark.slow  # measures a whole load's peak memory: 8 s
def test_online_quantization_peak_memory_is_about_one_layer(tmp_path):
    from h3gen.pipelines.h3.transformer import H3Transformer

    config = dict(
        num_attention_heads=4,
        attention_head_dim=128,
        hidden_size=512,
        num_layers=8,
        num_refiner_layers=1,
        ffn_dim=2048,
        text_dim=64,
        freq_dim=32,
        time_embed_hidden_dim=64,
        time_embed_dim=64,
        rope_freq_dim=16,
    )
    model = H3Transformer.from_config(config)
    model.save_pretrained(tmp_path, max_shard_bytes=64 * 2**20)
    checkpoint = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    largest = max(p.numel() for p in model.parameters()) * 8  # the float64 working copy of the largest tensor
    del model
    # glibc would otherwise serve these tensors from its heap and keep freed pages, so the resident size would show
    # its high-water mark rather than the memory actually live; with mmap for large blocks, freed means returned.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    result = subprocess.run(
        [sys.executable, "-c", ONLINE, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    grown, kept = (int(v) for v in result.stdout.strip().splitlines()[-1].split())
    print(
        f"online MXFP4 load: checkpoint {checkpoint / 2**20:.0f} MiB, model kept {kept / 2**20:.0f} MiB, "
        f"peak private growth {grown / 2**20:.0f} MiB"
    )
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
        "a cat", **kwargs
    )
    video_error = np.linalg.norm(quant.video - plain.video) / np.linalg.norm(plain.video)
    audio_error = np.linalg.norm(quant.audio - plain.audio) / np.linalg.norm(plain.audio)
    print(f"tiny pipeline mxfp4 vs fp32: video rel L2 {video_error:.2e}, audio rel L2 {audio_error:.2e}")
    # measured 1.7e-3 (video) and 4.5e-4 (audio, through the tiny checkpoint's three-stage audio VAE); bounds half
    # and twice that
    assert 8.5e-4 < video_error < 3.4e-3 and 2.25e-4 < audio_error < 9.0e-4
