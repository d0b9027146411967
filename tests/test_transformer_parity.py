"""H3Transformer against diffusers' MiniMaxH3Transformer3DModel with identical random weights."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from helpers.h3_tiny import TINY_CONFIGS, cast_with_islands_, max_rel_err, random_inputs, randomize_

from h3gen.pipelines.h3.transformer import H3Transformer

# Odd row counts, 1-3 distinct timesteps, keyframe conditioning rows, vision-tagged text rows, batch 2.
CASES = [
    dict(config=0, num_text=7, latent_frames=3, latent_hw=(4, 6), audio_latents=5, distinct_timesteps=1),
    dict(
        config=1,
        num_text=11,
        latent_frames=2,
        latent_hw=(6, 2),
        audio_latents=9,
        anchors=("first",),
        vision_rows=3,
        distinct_timesteps=3,
    ),
    dict(
        config=2,
        num_text=5,
        latent_frames=7,
        latent_hw=(2, 4),
        audio_latents=13,
        anchors=("first", "last"),
        distinct_timesteps=2,
        batch=2,
    ),
]


def build_pair(config: dict, seed: int):
    reference = MiniMaxH3Transformer3DModel(**config).eval()
    randomize_(reference, seed)
    ours = H3Transformer.from_config(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs, return_dict=False)
    return out[0], out[1]


def test_state_dict_keys_equal_diffusers():
    for config in TINY_CONFIGS:
        reference = MiniMaxH3Transformer3DModel(**config)
        ours = H3Transformer.from_config(config)
        assert list(ours.state_dict()) == list(reference.state_dict())
        for key, tensor in reference.state_dict().items():
            assert ours.state_dict()[key].shape == tensor.shape, key


@pytest.mark.parametrize("case", range(len(CASES)))
def test_transformer_matches_diffusers_fp32(case):
    spec = dict(CASES[case])
    config = TINY_CONFIGS[spec.pop("config")]
    reference, ours = build_pair(config, seed=case)
    inputs = random_inputs(config, seed=100 + case, **spec)
    ref_video, ref_audio = run(reference, inputs)
    video, audio = run(ours, inputs)
    assert video.shape == ref_video.shape and audio.shape == ref_audio.shape
    assert max_rel_err(video, ref_video) <= 1e-5
    assert max_rel_err(audio, ref_audio) <= 1e-5
    assert ref_video.abs().max() > 1e-3  # the outputs carry signal, so the comparison means something


@pytest.mark.parametrize("case", range(len(CASES)))
def test_transformer_matches_diffusers_bf16(case):
    spec = dict(CASES[case])
    config = TINY_CONFIGS[spec.pop("config")]
    reference, ours = build_pair(config, seed=case)
    inputs = random_inputs(config, seed=200 + case, **spec)
    ref32_video, ref32_audio = run(reference, inputs)
    cast_with_islands_(reference, torch.bfloat16)
    cast_with_islands_(ours, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.proj_out.weight.dtype == torch.float32
    ref16_video, ref16_audio = run(reference, inputs)
    video, audio = run(ours, inputs)
    for got, ref16, ref32 in ((video, ref16_video, ref32_video), (audio, ref16_audio, ref32_audio)):
        assert got.dtype == ref16.dtype
        reference_error = max_rel_err(ref16, ref32)
        assert reference_error > 0  # bf16 really ran
        assert max_rel_err(got, ref32) <= 2 * reference_error


def test_forward_rejects_inconsistent_layout():
    config = TINY_CONFIGS[0]
    ours = H3Transformer.from_config(config)
    inputs = random_inputs(config, seed=0, num_text=4, latent_frames=2, latent_hw=(2, 2), audio_latents=3)
    inputs["token_tags"] = inputs["token_tags"][:-1]
    with pytest.raises(ValueError, match="token_tags"):
        ours(**inputs)
