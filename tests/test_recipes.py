"""Step-count semantics and few-step recipes: schedules against diffusers' `MiniMaxH3Scheduler`, recipe parsing
for every published file name, and the errors a request that contradicts its recipe gets."""

import pytest
import torch

from h3gen.errors import RequestError
from h3gen.pipelines.h3.recipes import (
    FLASHGEN_NAMES,
    Recipe,
    Sampling,
    parse_base_schedule,
    parse_turbo_name,
    recipe_for,
    resolve_sampling,
)
from h3gen.pipelines.h3.schedules import FlowSchedule

FLASHGEN_METADATA = {
    "key_format": "minimax-h3-native",
    "qkv_layout": "grouped",
    "lora_rank": "64",
    "lora_alpha": "64",
    "tasks": "t2va",
    "base_schedule": "1.0,0.7,0.4,0.15,0.0",
}


def _diffusers_scheduler(shift: float):
    from diffusers import MiniMaxH3Scheduler  # the reference side only

    scheduler = MiniMaxH3Scheduler(shift=12.0)
    scheduler.set_shift(shift)
    return scheduler


def _shifted(base, shift):
    """The shift in float64, written out independently of the code under test."""
    return [shift * b / (1 + (shift - 1) * b) for b in base]


# ------------------------------------------------------------------ step counts


@pytest.mark.parametrize("points", [2, 3, 5, 9, 50])
@pytest.mark.parametrize("shift", [12.0, 3.0, 6.0])
def test_num_inference_steps_are_diffusers_sigma_points(points, shift):
    scheduler = _diffusers_scheduler(shift)
    scheduler.set_timesteps(points)
    ours = FlowSchedule.make(points, shift)
    assert torch.equal(ours.sigmas, scheduler.sigmas) and torch.equal(ours.timesteps, scheduler.timesteps)
    assert len(ours) == scheduler.num_inference_steps == points - 1  # N points drive N - 1 forwards


@pytest.mark.parametrize("forwards", [1, 4, 8, 49])
def test_forwards_count_transformer_forwards(forwards):
    schedule = FlowSchedule.from_forwards(forwards, 12.0)
    scheduler = _diffusers_scheduler(12.0)
    scheduler.set_timesteps(forwards + 1)
    assert len(schedule) == forwards and torch.equal(schedule.sigmas, scheduler.sigmas)


def test_turbo_four_forward_grid_is_the_published_one():
    # ModelTC/Minimax-H3-Turbo README: N=4 at 12/3 gives video [1, 0.9730, 0.9231, 0.8000] -> 0 and audio
    # [1, 0.9, 0.75, 0.5] -> 0.
    video, audio = Sampling(4, 12.0, 3.0).schedules()
    assert video.sigmas.tolist() == pytest.approx([1, 0.9730, 0.9231, 0.8000, 0], abs=5e-5)
    assert audio.sigmas.tolist() == pytest.approx([1, 0.9, 0.75, 0.5, 0], abs=1e-6)


@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_base_schedule_grid_and_its_euler_steps_match_diffusers(shift):
    base = [1.0, 0.7, 0.4, 0.15, 0.0]
    ours = FlowSchedule.from_base(base, shift)
    assert ours.sigmas.tolist() == pytest.approx(_shifted(base, shift), rel=1e-6)
    assert len(ours) == 4
    scheduler = _diffusers_scheduler(shift)
    scheduler.set_timesteps(sigmas=_shifted(base, shift))  # diffusers takes explicit sigmas verbatim
    assert torch.allclose(ours.sigmas, scheduler.sigmas, rtol=0, atol=1e-7)
    generator = torch.Generator().manual_seed(0)
    ours_x = theirs_x = torch.randn(2, 3, 4, generator=generator)
    for i, t in enumerate(scheduler.timesteps):
        velocity = torch.randn(2, 3, 4, generator=generator)
        ours_x = ours.step(i, velocity, ours_x)
        theirs_x = scheduler.step(velocity, t, theirs_x).prev_sample
        assert torch.allclose(ours_x, theirs_x, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "base",
    [[1.0], [1.5, 0.0], [0.0, 0.0], [1.0, 0.5, 0.5, 0.0], [1.0, 0.4, 0.7, 0.0], [1.0, 0.3], [1.0, float("nan"), 0.0]],
)
def test_bad_base_schedules_are_refused(base):
    with pytest.raises(ValueError, match="base schedule"):
        FlowSchedule.from_base(base, 12.0)


# ------------------------------------------------------------------ recipes

TURBO_CASES = [
    # file name, forwards, video shift, tasks
    ("minimax_h3_fl2v_turbo_4step_v0.1.safetensors", 4, 12.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_4step_v0.1_bf16.safetensors", 4, 12.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_8step_v1.0.safetensors", 8, 12.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors", 8, 12.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_8step_v1.0_768p.safetensors", 8, 6.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_8step_v1.0_768p_bf16.safetensors", 8, 6.0, ("t2va", "fl2va")),
    ("minimax_h3_fl2v_turbo_4step_v1.0_768p_bf16.safetensors", 4, 6.0, ("t2va", "fl2va")),
    ("minimax_h3_ref2v_turbo_4step_v0.1.safetensors", 4, 12.0, ("ref2va",)),
    ("minimax_h3_ref2v_turbo_4step_v0.1_bf16.safetensors", 4, 12.0, ("ref2va",)),
    ("minimax_h3_ref2v_turbo_8step_v1.0_768p.safetensors", 8, 6.0, ("ref2va",)),
    ("minimax_h3_ref2v_turbo_8step_v1.0_768p_bf16.safetensors", 8, 6.0, ("ref2va",)),
]


@pytest.mark.parametrize("filename,forwards,video_shift,tasks", TURBO_CASES)
def test_turbo_recipe_from_every_file_name_variant(filename, forwards, video_shift, tasks):
    recipe = recipe_for(filename, {})
    assert recipe == parse_turbo_name(filename)
    assert (recipe.forwards, recipe.num_inference_steps) == (forwards, forwards + 1)
    assert (recipe.video_shift, recipe.audio_shift, recipe.tasks) == (video_shift, 3.0, tasks)
    assert recipe.base_schedule is None
    assert f"{forwards}-step" in recipe.name and ("768p" in recipe.name) == ("_768p" in filename)
    # Metadata does not change what the name says (the Turbo files carry only key_format and alpha).
    assert recipe_for(filename, {"key_format": "minimax-h3-diffusers", "alpha": "128"}) == recipe


@pytest.mark.parametrize(
    "filename",
    [
        "minimax_h3_fl2v_turbo_4step_v0.1.pt",
        "minimax_h3_t2v_turbo_4step_v0.1.safetensors",
        "minimax_h3_fl2v_turbo_4step.safetensors",
        "minimax_h3_fl2v_turbo_4step_v0.1_comfyui_bf16.safetensors",
        "minimax_h3_fl2v_turbo_4step_v0.1_1080p.safetensors",
        "xminimax_h3_fl2v_turbo_4step_v0.1.safetensors",
        "my_style.safetensors",
        "minimax_h3_fl2v_turbo_0step_v0.1.safetensors",
    ],
)
def test_other_names_bring_no_recipe(filename):
    assert recipe_for(filename, {}) is None


@pytest.mark.parametrize("filename", [*FLASHGEN_NAMES, "renamed_flashgen.safetensors"])
def test_flashgen_recipe_from_its_metadata(filename):
    recipe = recipe_for(filename, FLASHGEN_METADATA)
    assert recipe.name == "FlashGen 4-step" and recipe.forwards == 4 and recipe.num_inference_steps == 5
    assert recipe.base_schedule == (1.0, 0.7, 0.4, 0.15, 0.0) and recipe.tasks == ("t2va",)
    assert (recipe.video_shift, recipe.audio_shift) == (12.0, 3.0)
    video, audio = Sampling(recipe.forwards, recipe.video_shift, recipe.audio_shift, recipe.base_schedule).schedules()
    assert video.sigmas.tolist() == pytest.approx(_shifted(recipe.base_schedule, 12.0), rel=1e-6)
    assert audio.sigmas.tolist() == pytest.approx(_shifted(recipe.base_schedule, 3.0), rel=1e-6)


def test_flashgen_name_without_a_schedule_brings_none_and_a_broken_schedule_is_named():
    assert recipe_for(FLASHGEN_NAMES[0], {"key_format": "minimax-h3-native"}) is None
    with pytest.raises(RequestError, match="base_schedule") as caught:
        recipe_for(FLASHGEN_NAMES[1], {**FLASHGEN_METADATA, "base_schedule": "1.0,0.7,0.8,0.0"})
    assert caught.value.field == "loras"


def test_base_schedule_metadata_forms():
    assert parse_base_schedule("1.0,0.7,0.4,0.15,0.0") == (1.0, 0.7, 0.4, 0.15, 0.0)
    assert parse_base_schedule("[1, 0.5, 0]") == (1.0, 0.5, 0.0)
    assert parse_base_schedule([1, 0.25, 0]) == (1.0, 0.25, 0.0)
    with pytest.raises(ValueError):
        parse_base_schedule("{}")


# ------------------------------------------------------------------ resolving a request

TURBO8 = parse_turbo_name("minimax_h3_fl2v_turbo_8step_v1.0_768p_bf16.safetensors")
FLASHGEN = recipe_for(FLASHGEN_NAMES[1], FLASHGEN_METADATA)


def test_without_a_recipe_steps_and_shifts_are_the_callers():
    assert resolve_sampling("t2va") == Sampling(49, 12.0, 3.0)
    assert resolve_sampling("t2va", num_inference_steps=9).forwards == 8
    assert resolve_sampling("t2va", forwards=8).num_inference_steps == 9
    assert resolve_sampling("t2va", forwards=8, video_shift=5, default_shifts=(10.0, 2.0)) == Sampling(8, 5.0, 2.0)


def test_a_recipe_adapter_without_steps_runs_the_recipes():
    assert resolve_sampling("t2va", recipes=[TURBO8]) == Sampling(8, 6.0, 3.0, None, TURBO8.name)
    assert resolve_sampling("t2va", recipes=[FLASHGEN]) == Sampling(
        4, 12.0, 3.0, FLASHGEN.base_schedule, "FlashGen 4-step"
    )
    # Agreeing explicit values are fine, in either count.
    assert (
        resolve_sampling("fl2va", num_inference_steps=9, video_shift=6, audio_shift=3, recipes=[TURBO8]).forwards == 8
    )
    assert resolve_sampling("fl2va", forwards=8, recipes=[TURBO8]).forwards == 8


@pytest.mark.parametrize(
    "arguments,field,words",
    [
        (dict(task="t2va", num_inference_steps=8), "num_inference_steps", "num_inference_steps=8 (7 forwards)"),
        (dict(task="t2va", forwards=4), "forwards", "forwards=4"),
        (dict(task="t2va", video_shift=12.0), "video_shift", "video_shift 6"),
        (dict(task="t2va", audio_shift=1.0), "audio_shift", "audio_shift 3"),
        (dict(task="ref2va"), "task", "serves t2va, fl2va, not ref2va"),
    ],
)
def test_a_request_that_contradicts_its_recipe_is_refused_naming_it(arguments, field, words):
    task = arguments.pop("task")
    with pytest.raises(RequestError) as caught:
        resolve_sampling(task, recipes=[TURBO8], **arguments)
    assert caught.value.field == field
    assert TURBO8.name in str(caught.value) and words in str(caught.value)


def test_two_recipes_and_both_counts_are_refused():
    with pytest.raises(RequestError, match="FlashGen 4-step") as caught:
        resolve_sampling("t2va", recipes=[TURBO8, FLASHGEN])
    assert caught.value.field == "loras" and TURBO8.name in str(caught.value)
    with pytest.raises(RequestError, match="not both") as caught:
        resolve_sampling("t2va", num_inference_steps=9, forwards=8)
    assert caught.value.field == "forwards"


@pytest.mark.parametrize(
    "arguments,field",
    [
        (dict(num_inference_steps=1), "num_inference_steps"),
        (dict(num_inference_steps=1001), "num_inference_steps"),
        (dict(num_inference_steps=True), "num_inference_steps"),
        (dict(forwards=0), "forwards"),
        (dict(forwards=1000), "forwards"),
        (dict(forwards=2.0), "forwards"),
        (dict(video_shift=0), "video_shift"),
        (dict(audio_shift=float("inf")), "audio_shift"),
        (dict(video_shift="12"), "video_shift"),
    ],
)
def test_out_of_range_counts_and_shifts_name_the_field(arguments, field):
    with pytest.raises(RequestError) as caught:
        resolve_sampling("t2va", **arguments)
    assert caught.value.field == field


def test_recipe_description_names_both_counts():
    described = Recipe("x", 8, 6.0, 3.0, ("t2va",)).describe()
    assert described["forwards"] == 8 and described["num_inference_steps"] == 9
    assert Sampling(8, 6.0, 3.0, recipe="x").describe() == {
        "num_inference_steps": 9,
        "forwards": 8,
        "video_shift": 6.0,
        "audio_shift": 3.0,
        "recipe": "x",
    }
