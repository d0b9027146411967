"""H3Pipeline end to end against diffusers' MiniMax-H3 ModularPipeline, on tiny checkpoints (fp32, CPU)."""

import shutil

import numpy as np
import pytest
import torch
from helpers.h3_reference import load_reference, run_reference
from PIL import Image

from h3gen.errors import CheckpointError, RequestError
from h3gen.media import probe_mp4
from h3gen.pipelines.h3.pipeline import H3Pipeline
from h3gen.pipelines.h3.tiny_checkpoint import build_image_processor

# Whole tiny pipelines against diffusers' on the CPU: outside the fast tier.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def diffusers_saved_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint loaded by diffusers and written back by diffusers' own `save_pretrained`. The processor
    cannot be saved without torchvision (transformers' Qwen3VLVideoProcessor needs it), so its files are written
    beside it by hand."""
    folder = tmp_path_factory.mktemp("diffusers_saved")
    pipe = load_reference(tiny_dir, "fl2va")
    pipe.update_components(processor=None)
    pipe.save_pretrained(str(folder), overwrite_modular_index=True)
    shutil.copytree(tiny_dir / "tokenizer", folder / "processor")
    build_image_processor().save_pretrained(folder / "processor")
    return folder


@pytest.fixture(scope="session")
def ours(tiny_dir):
    return H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, workflow="fl2va")


def _keyframes():
    rng = np.random.default_rng(5)
    first = Image.fromarray(rng.integers(0, 256, (45, 80, 3), dtype=np.uint8))
    last = Image.fromarray(rng.integers(0, 256, (70, 52, 3), dtype=np.uint8))
    return first, last


def _assert_close(output, reference):
    video, audio = reference[0], reference[1]
    assert output.video.shape == video.shape and output.audio.shape == audio.shape
    assert output.video.dtype == np.float32 and output.audio.dtype == np.float32
    assert np.abs(output.video - video).max() <= TOLERANCE
    assert np.abs(output.audio - audio).max() <= TOLERANCE
    assert output.video.std() > 1e-3 and np.abs(output.audio).max() > 1e-5  # real content, not zeros


@pytest.mark.parametrize("which", ["ours", "diffusers_saved"])
def test_t2va_matches_diffusers(which, request):
    folder = request.getfixturevalue("tiny_dir" if which == "ours" else "diffusers_saved_dir")
    reference = run_reference(
        load_reference(folder, "t2va"), "a red fox runs through snow", seed=11, num_frames=130, num_inference_steps=4
    )
    pipe = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)
    output = pipe("a red fox runs through snow", num_frames=130, num_inference_steps=4, seed=11)
    assert output.video.shape[0] == 141  # 130 snapped up to 17n+5
    _assert_close(output, reference)


@pytest.mark.parametrize("keys", [("image",), ("last_image",), ("image", "last_image")])
def test_fl2va_matches_diffusers(keys, tiny_dir, ours):
    first, last = _keyframes()
    frames = {"image": first, "last_image": last}
    kwargs = {key: frames[key] for key in keys}
    reference = run_reference(load_reference(tiny_dir, "fl2va"), "a bird", seed=4, num_inference_steps=3, **kwargs)
    _assert_close(ours("a bird", num_inference_steps=3, seed=4, **kwargs), reference)


def test_fl2va_matches_diffusers_on_diffusers_saved_checkpoint(diffusers_saved_dir):
    first, _ = _keyframes()
    reference = run_reference(
        load_reference(diffusers_saved_dir, "fl2va"),
        "waves",
        seed=2,
        height=64,
        width=96,
        num_inference_steps=3,
        image=first,
    )
    pipe = H3Pipeline.from_pretrained(diffusers_saved_dir, device="cpu", torch_dtype=torch.float32, workflow="fl2va")
    _assert_close(pipe("waves", height=64, width=96, num_inference_steps=3, seed=2, image=first), reference)


def test_latents_from_a_seed_reproduce_that_seed(ours):
    first, _ = _keyframes()
    kwargs = dict(num_inference_steps=3, image=first, seconds=6)
    seeded = ours("rain on a window", seed=9, **kwargs)
    latents, audio_latents = ours.initial_noise(seed=9, image=first, seconds=6)
    assert audio_latents.shape == (2, 32, seeded.audio.shape[1] // 800)
    # The condition noise still comes from a generator: a different seed there moves only the conditioning.
    reproduced = ours("rain on a window", seed=9, latents=latents, audio_latents=audio_latents, **kwargs)
    assert np.array_equal(reproduced.video, seeded.video) and np.array_equal(reproduced.audio, seeded.audio)
    t2va = dict(num_inference_steps=3)
    plain = ours("rain", seed=5, **t2va)
    latents, audio_latents = ours.initial_noise(seed=5)
    again = ours("rain", seed=123, latents=latents, audio_latents=audio_latents, **t2va)
    assert np.array_equal(again.video, plain.video) and np.array_equal(again.audio, plain.audio)
    assert not np.array_equal(ours("rain", seed=6, **t2va).video, plain.video)


@pytest.mark.parametrize("rate", [32000, 48000])
def test_mp4_decodes_back(ours, tmp_path, rate):
    output = ours("a drum solo", num_inference_steps=2, seed=1, seconds=5.5)
    path = tmp_path / "clip.mp4"
    output.save(path, audio_sample_rate=rate)
    info = probe_mp4(path)
    assert info.num_frames == output.video.shape[0] == 141
    assert (info.height, info.width) == output.video.shape[1:3]
    assert info.fps == 24 and info.audio_channels == 2 and info.sample_rate == rate
    assert abs(info.audio_seconds - info.video_seconds) <= 1 / 24
    assert not list(tmp_path.glob(".*partial*"))  # no temporary file left behind


def test_callback_reports_every_stage_and_step(ours):
    first, last = _keyframes()
    events = []
    ours(
        "x",
        num_inference_steps=5,
        seed=0,
        image=first,
        last_image=last,
        callback=lambda stage, step, total: events.append((stage, step, total)),
    )
    # Each stage reports its start (step 0, repeated at its cancellation points inside) and each unit of work done.
    assert [e for e in events if e[0] == "denoise"] == [("denoise", i, 4) for i in range(0, 5)]
    done = [e for e in events if e[1] > 0 and e[0] != "denoise"]
    assert done == [
        ("encode_text", 1, 1),
        *[("encode_conditions", 1, 2)] * 8,
        ("encode_conditions", 2, 2),
        ("decode_video", 1, 1),
        ("decode_audio", 1, 1),
    ]
    stages = [stage for index, (stage, _, _) in enumerate(events) if index == 0 or events[index - 1][0] != stage]
    assert stages == ["encode_text", "encode_conditions", "denoise", "decode_video", "decode_audio"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(aspect_ratio="1:5"), "aspect_ratio"),
        (dict(seconds=2.0), "seconds"),
        (dict(seconds=61), "seconds"),  # over the 60 s limit (16 to 60 s are made in windows)
        (dict(height=64, width=100), "width"),
        (dict(num_inference_steps=1), "num_inference_steps"),
        (dict(seed=-1), "seed"),
        (dict(latents=torch.zeros(1, 24, 3, 4, 4)), "latents"),
        (dict(image="/nonexistent.png"), "image"),
    ],
)
def test_bad_requests_raise_request_error_naming_the_field(ours, kwargs, field):
    with pytest.raises(RequestError) as info:
        ours("a prompt", **kwargs)
    assert info.value.field == field


def test_missing_component_folder_is_named(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    shutil.rmtree(broken / "audio_vae")
    with pytest.raises(CheckpointError, match="no audio_vae/ component folder"):
        H3Pipeline.from_pretrained(broken, device="cpu")


def test_t2va_bf16_matches_diffusers_bf16(tiny_dir):
    reference = run_reference(
        load_reference(tiny_dir, "t2va", dtype=torch.bfloat16), "a cat", seed=0, num_inference_steps=4
    )
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.transformer.proj_out.weight.dtype == torch.float32
    assert pipe.audio_vae.dtype == torch.float32
    _assert_close(pipe("a cat", num_inference_steps=4, seed=0), reference)
