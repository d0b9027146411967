"""Validating a generation request once, before any model work: prompt, keyframes or references, geometry, steps,
seed, noise.

`prepare_request` needs only the checkpoint index and the transformer config, so the CLI and the server can reject
a bad request before loading tens of gigabytes of weights.
"""

import secrets
from dataclasses import dataclass, field

import torch

from h3gen.errors import RequestError
from h3gen.loading.files import read_json
from h3gen.media import read_image
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.recipes import Recipe, Sampling, resolve_sampling
from h3gen.pipelines.h3.references import PreparedReference, as_references, prepare_references, sound_seconds
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT, read_shift
from h3gen.pipelines.h3.tasks import place_keyframes
from h3gen.pipelines.h3.transformer import H3TransformerConfig

DEFAULT_SECONDS = 5.0
KEYFRAME_NOISE_AUG = 0.999  # conditioning rows are held just short of clean
MAX_SEED = 2**63 - 1


@dataclass
class H3Request:
    """A validated request: everything the stages need, nothing they must re-check."""

    prompt: str
    keyframes: list  # RGB PIL images already on the canvas, in packed order
    anchors: tuple[str, ...]  # "first" / "last" per keyframe
    shape: geometry.Geometry
    sampling: Sampling  # forwards, shifts and grid (a recipe's when an adapter brings one)
    generator: torch.Generator
    seed: int | None  # None when the caller brought its own generator
    latents: torch.Tensor | None
    audio_latents: torch.Tensor | None
    references: list[PreparedReference] = field(default_factory=list)  # ref2va, normalized, in order

    @property
    def task(self) -> str:
        return "ref2va" if self.references else "fl2va" if self.keyframes else "t2va"

    @property
    def num_inference_steps(self) -> int:
        """Sigma grid points, diffusers' count (`sampling.forwards` + 1)."""
        return self.sampling.num_inference_steps


def _check_int(value, name: str, low: int, high: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer from {low} to {what} (got {value!r}).", name)


def prepare_request(
    checkpoint: H3Checkpoint,
    config: H3TransformerConfig,
    prompt,
    *,
    image=None,
    last_image=None,
    references=None,
    aspect_ratio=None,
    seconds=None,
    num_frames=None,
    height=None,
    width=None,
    num_inference_steps=None,
    forwards=None,
    video_shift=None,
    audio_shift=None,
    recipes: list[Recipe] = (),
    default_shifts: tuple[float, float] | None = None,
    seed=None,
    generator=None,
    latents=None,
    audio_latents=None,
) -> H3Request:
    """Check every argument of `H3Pipeline.__call__` and resolve the geometry; raise `RequestError` naming the
    field and the allowed range. Keyframes are read and placed on the canvas here; references are decoded and
    normalized here. Without `seconds` or `num_frames` a request lasts 5 s, or for ref2va as long as its first
    reference that carries sound (held within 5 to 15 s).

    Steps: `num_inference_steps` counts sigma grid points as diffusers does (N points, N - 1 transformer forwards),
    `forwards` counts transformer forwards; give one or neither (50 points, or the recipe's). `recipes` are the
    few-step recipes of the request's adapters, which the step count, the shifts and the task must agree with.
    Shifts left None take the recipe's, else `default_shifts` (default: the checkpoint's scheduler configs)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt must be a non-empty string.", "prompt")
    task = "ref2va" if references is not None else "fl2va" if image is not None or last_image is not None else "t2va"
    sampling = resolve_sampling(task, num_inference_steps=num_inference_steps, forwards=forwards,
                                video_shift=video_shift, audio_shift=audio_shift, recipes=recipes,
                                default_shifts=default_shifts or checkpoint_shifts(checkpoint))
    if seed is not None:
        _check_int(seed, "seed", 0, MAX_SEED, "2**63-1")
        if generator is not None:
            raise RequestError("give seed or generator, not both.", "seed")

    keyframes, anchors = [], []
    for anchor, source, name in (("first", image, "image"), ("last", last_image, "last_image")):
        if source is not None:
            keyframes.append(read_image(source, name))
            anchors.append(anchor)
    if keyframes and "processor" not in checkpoint.components:
        raise RequestError("this model has no processor/ folder, so it cannot take keyframes.", "image")
    if references is not None:
        if keyframes:
            raise RequestError("give keyframes (image / last_image, fl2va) or references (ref2va), not both.",
                               "references")
        references = as_references(references)
        if "processor" not in checkpoint.components:
            raise RequestError("this model has no processor/ folder, so it cannot take references.",
                               "references")
        if seconds is None and num_frames is None:
            found = sound_seconds(references)
            if found is not None:  # as long as the sound, within what the model generates
                seconds = min(max(found[0], geometry.MIN_SECONDS), geometry.MAX_SECONDS)
    if seconds is None and num_frames is None:
        seconds = DEFAULT_SECONDS

    if aspect_ratio is None and height is None:
        # t2va and ref2va generate on 16:9 (references never set the canvas); fl2va on the first keyframe's own
        # aspect ratio, as the reference does.
        aspect_ratio = keyframes[0].size if keyframes else "16:9"
    shape = geometry.resolve_geometry(
        aspect_ratio=aspect_ratio, seconds=seconds, num_frames=num_frames, height=height, width=width,
        multiple=geometry.SPATIAL_COMPRESSION * config.patch_size[2], short_edge=checkpoint.canvas_short_edge,
        max_pixels=checkpoint.canvas_max_pixels,
    )
    keyframes = place_keyframes(keyframes, shape.height, shape.width)
    prepared = []
    if references is not None:
        prepared = prepare_references(
            references, shape.num_frames, multiple=geometry.SPATIAL_COMPRESSION * config.patch_size[2],
            short_edge=checkpoint.canvas_short_edge, max_pixels=checkpoint.canvas_max_pixels,
            image_short_edge=checkpoint.reference_image_short_edge,
        )

    expected = (1, config.in_channels, shape.num_latent_frames, shape.latent_height, shape.latent_width)
    if latents is not None and tuple(latents.shape) != expected:
        raise RequestError(f"latents must have shape {expected} for this request (got {tuple(latents.shape)}).",
                           "latents")
    expected = (2, config.audio_in_channels, shape.num_audio_latents)
    if audio_latents is not None and tuple(audio_latents.shape) != expected:
        raise RequestError(
            f"audio_latents must have shape {expected} for this request (got {tuple(audio_latents.shape)}).",
            "audio_latents",
        )
    if generator is None:
        seed = secrets.randbelow(2**31) if seed is None else seed
        generator = torch.Generator().manual_seed(seed)
    return H3Request(prompt, keyframes, tuple(anchors), shape, sampling, generator, seed, latents,
                     audio_latents, prepared)


def checkpoint_shifts(checkpoint: H3Checkpoint) -> tuple[float, float]:
    """(video, audio) shifts of the checkpoint's `scheduler/` and `audio_scheduler/` configs (12 and 3 when a
    folder or its config is missing)."""
    shifts = []
    for name, default in (("scheduler", VIDEO_SHIFT), ("audio_scheduler", AUDIO_SHIFT)):
        folder = checkpoint.components.get(name)
        shifts.append(default if folder is None else read_shift(folder, default))
    return shifts[0], shifts[1]


def read_transformer_config(checkpoint: H3Checkpoint) -> H3TransformerConfig:
    """The transformer's config from `transformer/config.json` (or `transformer_ref/`'s, same architecture), without
    loading any weights."""
    name = "transformer" if "transformer" in checkpoint.components or "transformer_ref" not in checkpoint.components \
        else "transformer_ref"
    return H3TransformerConfig.from_dict(read_json(checkpoint.folder(name) / "config.json"))
