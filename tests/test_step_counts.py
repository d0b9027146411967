"""Step counts through `H3Pipeline` on the tiny checkpoint: `forwards=N` runs exactly N transformer forwards,
diffusers' `num_inference_steps=N` runs N - 1, and per-call shifts match diffusers' scheduler with that shift."""

import numpy as np
import pytest
import torch
from helpers.h3_reference import load_reference, run_reference

from h3gen.errors import RequestError
from h3gen.pipelines.h3.pipeline import H3Pipeline


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


@pytest.mark.parametrize(
    "kwargs,forwards",
    [(dict(forwards=8), 8), (dict(num_inference_steps=8), 7), (dict(forwards=1), 1), (dict(num_inference_steps=2), 1)],
)
def test_forwards_and_sigma_points(pipe, kwargs, forwards):
    calls, output = _count_forwards(pipe, **kwargs)
    assert calls == forwards == output.forwards
    assert output.num_inference_steps == forwards + 1
    assert output.sampling == {
        "num_inference_steps": forwards + 1,
        "forwards": forwards,
        "video_shift": 12.0,
        "audio_shift": 3.0,
        "recipe": None,
        "sparsity": None,
    }


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


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_inference_steps=5, forwards=4), "forwards"),
        (dict(forwards=0), "forwards"),
        (dict(video_shift=-1.0), "video_shift"),
    ],
)
def test_bad_step_arguments_name_the_field(pipe, kwargs, field):
    with pytest.raises(RequestError) as caught:
        pipe("x", **kwargs)
    assert caught.value.field == field


# ------------------------------------------------------------------ recipe adapters through the pipeline


@pytest.fixture(scope="module")
def recipe_files(tiny_dir, tmp_path_factory):
    from helpers.recipe_files import write_flashgen, write_turbo

    folder = tmp_path_factory.mktemp("recipes")
    return write_turbo(folder, tiny_dir), write_flashgen(folder, tiny_dir)


def test_a_turbo_adapter_runs_its_recipe(pipe, recipe_files):
    turbo, _ = recipe_files
    calls, output = _count_forwards(pipe, loras=[turbo])
    assert calls == 8 == output.forwards and output.num_inference_steps == 9
    assert output.sampling == {
        "num_inference_steps": 9,
        "forwards": 8,
        "video_shift": 6.0,
        "audio_shift": 3.0,
        "recipe": "LightX2V Turbo fl2v 8-step v1.0 768p",
        "sparsity": None,
    }
    assert output.loras == [(turbo.stem, 1.0)]
    # Explicit agreeing counts run the same; the next call without the adapter is back to the caller's steps.
    assert _count_forwards(pipe, loras=[(turbo, 0.5)], num_inference_steps=9)[0] == 8
    assert _count_forwards(pipe, forwards=2)[0] == 2


def test_a_flashgen_adapter_runs_four_forwards_on_its_base_schedule(pipe, recipe_files):
    _, flashgen = recipe_files
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].flatten()[0].item()), with_kwargs=True
    )
    try:
        output = pipe("x", seed=1, decode=False, loras=[flashgen])
    finally:
        handle.remove()
    base = [1.0, 0.7, 0.4, 0.15]
    video_t = [1 - 12 * b / (1 + 11 * b) for b in base]
    assert len(seen) == 4 and output.sampling["recipe"] == "FlashGen 4-step"
    assert seen == pytest.approx(video_t, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs,field,words",
    [
        (dict(num_inference_steps=8), "num_inference_steps", "num_inference_steps=8 (7 forwards)"),
        (dict(forwards=4), "forwards", "forwards=4"),
        (dict(video_shift=12.0), "video_shift", "video_shift 6"),
    ],
)
def test_a_call_that_contradicts_its_recipe_is_refused_before_any_work(pipe, recipe_files, kwargs, field, words):
    turbo, _ = recipe_files
    calls = []
    handle = pipe.text_encoder.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(RequestError) as caught:
            pipe("x", loras=[turbo], **kwargs)
    finally:
        handle.remove()
    assert caught.value.field == field and "LightX2V Turbo fl2v 8-step v1.0 768p" in str(caught.value)
    assert words in str(caught.value) and not calls


def test_two_recipe_adapters_are_refused(pipe, recipe_files):
    with pytest.raises(RequestError, match="2 few-step recipes") as caught:
        pipe("x", loras=list(recipe_files))
    assert caught.value.field == "loras"
