"""Step counts through `H3Pipeline` on the tiny checkpoint: `forwards=N` runs exactly N transformer forwards,
diffusers' `num_inference_steps=N` runs N - 1, and per-call shifts match diffusers' scheduler with that shift."""

import numpy as np
import pytest
import torch
from h3_reference import load_reference, run_reference

from h3gen.errors import RequestError
from h3gen.pipelines.h3.pipeline import H3Pipeline
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    return H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)


def _count_forwards(pipe, **kwargs):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        output = pipe("a lighthouse at night", seed=3, decode=False, **kwargs)
    finally:
        handle.remove()
    return len(calls), output


@pytest.mark.parametrize("kwargs,forwards", [
    (dict(forwards=8), 8), (dict(num_inference_steps=8), 7), (dict(forwards=1), 1), (dict(num_inference_steps=2), 1)])
def test_forwards_and_sigma_points(pipe, kwargs, forwards):
    calls, output = _count_forwards(pipe, **kwargs)
    assert calls == forwards == output.forwards
    assert output.num_inference_steps == forwards + 1
    assert output.sampling == {"num_inference_steps": forwards + 1, "forwards": forwards, "video_shift": 12.0,
                               "audio_shift": 3.0, "recipe": None}


def test_default_is_fifty_sigma_points(pipe):
    request = pipe.validate("x")
    assert (request.num_inference_steps, request.sampling.forwards) == (50, 49)


def test_forwards_and_shifts_match_diffusers(tiny_dir, pipe):
    reference = load_reference(tiny_dir, "t2va")
    reference.scheduler.set_shift(6.0)
    reference.audio_scheduler.set_shift(2.0)
    video, audio, _, _ = run_reference(reference, "a red fox", seed=11, num_inference_steps=4)
    output = pipe("a red fox", forwards=3, video_shift=6.0, audio_shift=2.0, seed=11)
    assert np.abs(output.video - video).max() <= 1e-4 and np.abs(output.audio - audio).max() <= 1e-4
    # The shifts are per call: the pipeline's own are unchanged, and a call at the default shifts differs.
    assert (pipe.video_shift, pipe.audio_shift) == (12.0, 3.0)
    assert np.abs(pipe("a red fox", forwards=3, seed=11).video - video).max() > 1e-3


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_inference_steps=5, forwards=4), "forwards"), (dict(forwards=0), "forwards"),
    (dict(video_shift=-1.0), "video_shift")])
def test_bad_step_arguments_name_the_field(pipe, kwargs, field):
    with pytest.raises(RequestError) as caught:
        pipe("x", **kwargs)
    assert caught.value.field == field
