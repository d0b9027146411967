"""Few-step recipes: the sampling contract a distilled adapter was trained for, and how one request's step count
and shifts are resolved against it.

A recipe fixes the number of transformer forwards, the video / audio shifts, the tasks it serves and, for
DMD2-style adapters, the base positions of the grid. Two families are recognised:

- LightX2V Turbo, by file name `minimax_h3_(fl2v|ref2v)_turbo_<N>step_v<x.y>[_768p][_bf16].safetensors` (the name is
  where its contract is recorded): N forwards on the uniform grid, shifts 12 / 3 (6 / 3 for the `_768p` files);
  fl2v files serve t2va and fl2va, ref2v files ref2va.
- FlashGen, by safetensors metadata (`key_format=minimax-h3-native` with a `base_schedule`, e.g.
  "1.0,0.7,0.4,0.15,0.0"): one forward per interval of that base schedule, shifted per modality (12 / 3), t2va.

Step counts: `num_inference_steps` counts sigma grid points as diffusers does (N points, N - 1 forwards);
`forwards` counts transformer forwards as SGLang and vLLM-Omni do. A request gives one or neither.
"""

import json
import math
import re
from dataclasses import dataclass

from h3gen.errors import RequestError
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT, FlowSchedule, check_base_schedule

DEFAULT_SIGMA_POINTS = 50  # diffusers' default num_inference_steps: 49 forwards
MAX_SIGMA_POINTS = 1000
# Shifts a request may ask: at 0.01 and 100 every grid up to 1,000 points keeps its points apart in float32
# (`resolve_sampling` checks the grid it built all the same); far below, sigmas underflow to 0 and steps vanish.
MIN_SHIFT, MAX_SHIFT = 0.01, 100.0

TURBO_NAME = re.compile(
    r"^minimax_h3_(?P<task>fl2v|ref2v)_turbo_(?P<steps>\d+)step_v(?P<version>\d+\.\d+)"
    r"(?P<res>_768p)?(?P<bf16>_bf16)?\.safetensors$"
)
TURBO_TASKS = {"fl2v": ("t2va", "fl2va"), "ref2v": ("ref2va",)}
TURBO_VIDEO_SHIFT = {"544p": 12.0, "768p": 6.0}
TURBO_AUDIO_SHIFT = 3.0
# The two names the FlashGen v1.0 file is published under (its model card's, and the one vLLM-Omni requires).
FLASHGEN_NAMES = (
    "minimax_h3_4step_lora_flashgen_v1.0_768p_bf16.safetensors",
    "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors",
)
NATIVE_KEY_FORMAT = "minimax-h3-native"


@dataclass(frozen=True)
class Recipe:
    """The sampling contract of one distilled adapter.

    name: how messages name it ("LightX2V Turbo fl2v 8-step v1.0 768p", "FlashGen 4-step").
    forwards: transformer forwards (sigma points = forwards + 1).
    video_shift, audio_shift: the shifts it was distilled with.
    tasks: the tasks it serves.
    base_schedule: explicit base positions (1.0 ... 0.0, before the shift), or None for the uniform grid.
    """

    name: str
    forwards: int
    video_shift: float
    audio_shift: float
    tasks: tuple[str, ...]
    base_schedule: tuple[float, ...] | None = None

    @property
    def num_inference_steps(self) -> int:
        """The recipe's step count as diffusers counts it: sigma grid points."""
        return self.forwards + 1

    def describe(self) -> dict:
        """A JSON-able summary (GET /v1/loras, job status)."""
        return {
            "name": self.name,
            "forwards": self.forwards,
            "num_inference_steps": self.num_inference_steps,
            "video_shift": self.video_shift,
            "audio_shift": self.audio_shift,
            "tasks": list(self.tasks),
            "base_schedule": list(self.base_schedule) if self.base_schedule else None,
        }


def parse_turbo_name(filename: str) -> Recipe | None:
    """The recipe a LightX2V Turbo file name encodes, or None for any other name."""
    match = TURBO_NAME.match(filename)
    if match is None or int(match["steps"]) < 1:
        return None
    resolution = "768p" if match["res"] else "544p"
    name = f"LightX2V Turbo {match['task']} {int(match['steps'])}-step v{match['version']}" + (
        " 768p" if match["res"] else ""
    )
    return Recipe(
        name, int(match["steps"]), TURBO_VIDEO_SHIFT[resolution], TURBO_AUDIO_SHIFT, TURBO_TASKS[match["task"]]
    )


def parse_base_schedule(raw) -> tuple[float, ...]:
    """A metadata `base_schedule`: "1.0,0.7,0.4,0.15,0.0", a JSON list, or a list of numbers. Raises `ValueError`
    for anything else or a schedule that does not run from 1.0 strictly down to 0.0."""
    if isinstance(raw, str):
        text = raw.strip()
        values = json.loads(text) if text.startswith("[") else [part for part in text.split(",") if part.strip()]
    else:
        values = raw
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"base_schedule must be a list of numbers (got {raw!r}).")
    schedule = [float(value) for value in values]
    check_base_schedule(schedule)
    return tuple(schedule)


def recipe_for(filename: str, metadata: dict | None) -> Recipe | None:
    """The recipe of an adapter file, from its name (Turbo) or its safetensors metadata (FlashGen and other
    `base_schedule` adapters), or None for an ordinary adapter. Raises `RequestError` (field "loras") for a
    `base_schedule` it cannot read."""
    turbo = parse_turbo_name(filename)
    if turbo is not None:
        return turbo
    metadata = metadata or {}
    raw = metadata.get("base_schedule")
    if raw is None:
        return None
    try:
        base = parse_base_schedule(raw)
    except (ValueError, TypeError) as error:
        raise RequestError(f"LoRA {filename}: its metadata base_schedule is not usable: {error}", "loras") from None
    tasks = tuple(task.strip() for task in str(metadata.get("tasks", "t2va")).split(",") if task.strip())
    flashgen = filename in FLASHGEN_NAMES or metadata.get("key_format") == NATIVE_KEY_FORMAT
    name = f"FlashGen {len(base) - 1}-step" if flashgen else f"{filename} base_schedule"
    return Recipe(name, len(base) - 1, VIDEO_SHIFT, AUDIO_SHIFT, tasks or ("t2va",), base)


@dataclass(frozen=True)
class Sampling:
    """How one request samples: forwards, shifts, the base grid (None: uniform) and the recipe it follows."""

    forwards: int
    video_shift: float
    audio_shift: float
    base_schedule: tuple[float, ...] | None = None
    recipe: str | None = None

    @property
    def num_inference_steps(self) -> int:
        """Sigma grid points as diffusers counts them (forwards + 1)."""
        return self.forwards + 1

    def schedules(self) -> tuple[FlowSchedule, FlowSchedule]:
        """The (video, audio) schedules, each float32 on the CPU."""
        if self.base_schedule is not None:
            return (
                FlowSchedule.from_base(self.base_schedule, self.video_shift),
                FlowSchedule.from_base(self.base_schedule, self.audio_shift),
            )
        return (
            FlowSchedule.from_forwards(self.forwards, self.video_shift),
            FlowSchedule.from_forwards(self.forwards, self.audio_shift),
        )

    def describe(self) -> dict:
        """Both step counts, the shifts and the recipe, as the job status and `H3Output` report them."""
        return {
            "num_inference_steps": self.num_inference_steps,
            "forwards": self.forwards,
            "video_shift": self.video_shift,
            "audio_shift": self.audio_shift,
            "recipe": self.recipe,
        }


def _check_int(value, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer from {low} to {high} (got {value!r}).", name)


def _check_shift(value, name: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not MIN_SHIFT <= value <= MAX_SHIFT
    ):
        raise RequestError(f"{name} must be a number from {MIN_SHIFT:g} to {MAX_SHIFT:g} (got {value!r}).", name)


def _check_grid(sampling: "Sampling") -> "Sampling":
    """`sampling` when both of its schedules hold `forwards` distinct steps, else a `RequestError` naming the
    shift that collapsed them (what validation accepts must run)."""
    for schedule, name in zip(sampling.schedules(), ("video_shift", "audio_shift"), strict=True):
        if len(schedule) != sampling.forwards or not bool(schedule.sigmas[-2] > 0):
            shift = sampling.video_shift if name == "video_shift" else sampling.audio_shift
            raise RequestError(
                f"{name} {shift:g} collapses the {sampling.forwards}-forward grid in float32; pick a "
                f"shift from {MIN_SHIFT:g} to {MAX_SHIFT:g} nearer 1.",
                name,
            )
    return sampling


def resolve_sampling(
    task: str,
    *,
    num_inference_steps=None,
    forwards=None,
    video_shift=None,
    audio_shift=None,
    recipes: list[Recipe] = (),
    default_shifts: tuple[float, float] = (VIDEO_SHIFT, AUDIO_SHIFT),
) -> Sampling:
    """One request's `Sampling`. `num_inference_steps` (sigma points, 2 to 1000) and `forwards` (1 to 999) are
    mutually exclusive; neither means the recipe's count, else 50 points. Shifts left None take the recipe's,
    else `default_shifts` (the pipeline's). Raises `RequestError` naming the field, and the recipe, when the
    request contradicts its adapter's recipe (another step count, shift or task, or two recipes at once)."""
    if num_inference_steps is not None and forwards is not None:
        raise RequestError(
            "give num_inference_steps (sigma grid points, diffusers' count: N points = N - 1 "
            "transformer forwards) or forwards (transformer forwards), not both.",
            "forwards",
        )
    if num_inference_steps is not None:
        _check_int(num_inference_steps, "num_inference_steps", 2, MAX_SIGMA_POINTS)
    if forwards is not None:
        _check_int(forwards, "forwards", 1, MAX_SIGMA_POINTS - 1)
    for value, name in ((video_shift, "video_shift"), (audio_shift, "audio_shift")):
        if value is not None:
            _check_shift(value, name)
    asked = forwards if forwards is not None else (num_inference_steps - 1 if num_inference_steps is not None else None)
    recipes = list(recipes)
    if len(recipes) > 1:
        names = ", ".join(recipe.name for recipe in recipes)
        raise RequestError(
            f"the adapters bring {len(recipes)} few-step recipes ({names}); a request follows at most "
            "one: stack one recipe adapter with ordinary adapters only.",
            "loras",
        )
    if not recipes:
        return _check_grid(
            Sampling(
                asked if asked is not None else DEFAULT_SIGMA_POINTS - 1,
                float(video_shift if video_shift is not None else default_shifts[0]),
                float(audio_shift if audio_shift is not None else default_shifts[1]),
            )
        )
    recipe = recipes[0]
    if task not in recipe.tasks:
        raise RequestError(f"the {recipe.name} recipe serves {', '.join(recipe.tasks)}, not {task}.", "task")
    if asked is not None and asked != recipe.forwards:
        field = "forwards" if forwards is not None else "num_inference_steps"
        given = (
            f"forwards={forwards}"
            if forwards is not None
            else f"num_inference_steps={num_inference_steps} ({asked} forwards)"
        )
        raise RequestError(
            f"the {recipe.name} recipe runs {recipe.forwards} transformer forwards "
            f"(num_inference_steps={recipe.num_inference_steps} sigma points or forwards="
            f"{recipe.forwards}); the request asks {given}. Leave the step count out to run the "
            "recipe's.",
            field,
        )
    for value, own, name in (
        (video_shift, recipe.video_shift, "video_shift"),
        (audio_shift, recipe.audio_shift, "audio_shift"),
    ):
        if value is not None and float(value) != own:
            raise RequestError(
                f"the {recipe.name} recipe samples with {name} {own:g}; the request asks "
                f"{float(value):g}. Leave it out to run the recipe's.",
                name,
            )
    return Sampling(recipe.forwards, recipe.video_shift, recipe.audio_shift, recipe.base_schedule, recipe.name)
