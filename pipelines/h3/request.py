"""Validating a generation request once, before any model work: prompt, keyframes or references, geometry, steps,
seed, noise.

`prepare_request` needs only the checkpoint index and the transformer config, so the CLI and the server can reject
a bad request before loading tens of gigabytes of weights.
"""

import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from h3gen.errors import RequestError
from h3gen.loading.files import read_json
from h3gen.media import read_image
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.continuation import (
    DEFAULT_MAX_SECONDS,
    ContinuationPlan,
    check_windows,
    clip_geometry,
    long_frames,
    plan_windows,
    window_prompts,
)
from h3gen.pipelines.h3.fasth3 import StudentContract, has_gates, read_student_contract
from h3gen.pipelines.h3.generation import MAX_SEED, GenerationRequest
from h3gen.pipelines.h3.preview import check_preview_every
from h3gen.pipelines.h3.recipes import Recipe, Sampling, resolve_sampling
from h3gen.pipelines.h3.references import PreparedReference, as_references, prepare_references, sound_seconds
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT, read_shift
from h3gen.pipelines.h3.sparse_attention import resolve_sparsity
from h3gen.pipelines.h3.tasks import place_keyframes
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

DEFAULT_SECONDS = 5.0
KEYFRAME_NOISE_AUG = 0.999  # conditioning rows are held just short of clean


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
    continuation: ContinuationPlan | None = None  # a clip longer than 15 s: its windows (shape: the whole clip)
    seconds: float | None = None  # the length asked for (or the default that applied); None when given in frames
    spec: GenerationRequest | None = None  # what was asked, as asked (with the seed that applied)
    sparsity: tuple[float, ...] | None = None  # per forward, VSA-H3's sparsity; None: dense attention throughout

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
    request: GenerationRequest,
    *,
    recipes: list[Recipe] = (),
    default_shifts: tuple[float, float] | None = None,
    generator=None,
    latents=None,
    audio_latents=None,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    student: StudentContract | None = None,
) -> H3Request:
    """Check every field of `request` and resolve the geometry; raise `RequestError` naming the field and the
    allowed range. Keyframes are read and placed on the canvas here; references are decoded and normalized here,
    once. Without `seconds` or `num_frames` a request lasts 5 s, or for ref2va as long as its first reference that
    carries sound (held within 5 to 15 s).

    A request longer than 15 s (up to `max_seconds`) becomes a continuation (`pipelines/h3/continuation.py`): its
    `shape` is the whole clip's and `continuation` holds its windows (`window_frames` / `overlap_frames`, on the
    17n+5 grid) and one prompt per window (`prompts`, or `prompt` for all). A request of 15 s or less is a plain one
    whatever the window options say (they are still checked); `prompts` may then hold its one prompt.

    `recipes` are the few-step recipes of the request's adapters, which the step count, the shifts and the task must
    agree with. Shifts left None take the recipe's, else `default_shifts` (default: the checkpoint's scheduler
    configs). `generator` (a `torch.Generator`, instead of the seed) and `latents` `(1, C, F, h, w)` /
    `audio_latents` `(2, C, A)` (initial noise instead of drawing it) are the Python caller's own."""
    prompt, image, last_image, references = request.prompt, request.image, request.last_image, request.references
    seconds, num_frames, prompts, seed = request.seconds, request.num_frames, request.prompts, request.seed
    aspect_ratio, height, width = request.aspect_ratio, request.height, request.width
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt must be a non-empty string.", "prompt")
    task = "ref2va" if references is not None else "fl2va" if image is not None or last_image is not None else "t2va"
    sampling = resolve_sampling(
        task,
        num_inference_steps=request.num_inference_steps,
        forwards=request.forwards,
        video_shift=request.video_shift,
        audio_shift=request.audio_shift,
        recipes=[student.recipe, *recipes] if student is not None else recipes,
        default_shifts=default_shifts or checkpoint_shifts(checkpoint),
    )
    sparsity = resolve_sparsity(
        request.sparsity, request.dense_forwards, sampling.forwards, student.sparsity if student is not None else None
    )
    check_preview_every(request.preview_every)
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
            raise RequestError(
                "give keyframes (image / last_image, fl2va) or references (ref2va), not both.", "references"
            )
        references = as_references(references)
        if "processor" not in checkpoint.components:
            raise RequestError("this model has no processor/ folder, so it cannot take references.", "references")
        if seconds is None and num_frames is None:
            found = sound_seconds(references)
            if found is not None:  # as long as the sound, within what the model generates
                seconds = min(max(found[0], geometry.MIN_SECONDS), geometry.MAX_SECONDS)
    if seconds is None and num_frames is None:
        seconds = DEFAULT_SECONDS
    asked_seconds = None if seconds is None else float(seconds)
    window, overlap = check_windows(request.window_frames, request.overlap_frames)
    total_frames = long_frames(seconds, num_frames, max_seconds)
    if total_frames is not None:
        if latents is not None or audio_latents is not None:
            raise RequestError(
                "latents / audio_latents are for requests of at most 15 s; a longer clip draws its "
                "noise per window from the seed.",
                "latents",
            )
        seconds, num_frames = None, window  # the canvas and the references are resolved for one window
    elif prompts is not None:
        prompt = window_prompts(prompt, prompts, 1)[0]

    if aspect_ratio is None and height is None:
        # t2va and ref2va generate on 16:9 (references never set the canvas); fl2va on the first keyframe's own
        # aspect ratio, as the reference does.
        aspect_ratio = keyframes[0].size if keyframes else "16:9"
    shape = geometry.resolve_geometry(
        aspect_ratio=aspect_ratio,
        seconds=seconds,
        num_frames=num_frames,
        height=height,
        width=width,
        multiple=geometry.SPATIAL_COMPRESSION * config.patch_size[2],
        short_edge=checkpoint.canvas_short_edge,
        max_pixels=checkpoint.canvas_max_pixels,
    )
    keyframes = place_keyframes(keyframes, shape.height, shape.width)
    prepared = []
    if references is not None:
        prepared = prepare_references(
            references,
            shape.num_frames,
            multiple=geometry.SPATIAL_COMPRESSION * config.patch_size[2],
            short_edge=checkpoint.canvas_short_edge,
            max_pixels=checkpoint.canvas_max_pixels,
            image_short_edge=checkpoint.reference_image_short_edge,
        )

    expected = (1, config.in_channels, shape.num_latent_frames, shape.latent_height, shape.latent_width)
    if latents is not None and tuple(latents.shape) != expected:
        raise RequestError(
            f"latents must have shape {expected} for this request (got {tuple(latents.shape)}).", "latents"
        )
    expected = (2, config.audio_in_channels, shape.num_audio_latents)
    if audio_latents is not None and tuple(audio_latents.shape) != expected:
        raise RequestError(
            f"audio_latents must have shape {expected} for this request (got {tuple(audio_latents.shape)}).",
            "audio_latents",
        )
    continuation = None
    if total_frames is not None:
        windows = plan_windows(total_frames, window, overlap)
        continuation = ContinuationPlan(
            tuple(windows), tuple(window_prompts(prompt, prompts, len(windows))), window, overlap
        )
        shape = clip_geometry(shape, total_frames)
    if generator is None:
        seed = secrets.randbelow(2**31) if seed is None else seed
        generator = torch.Generator().manual_seed(seed)
    return H3Request(
        prompt,
        keyframes,
        tuple(anchors),
        shape,
        sampling,
        generator,
        seed,
        latents,
        audio_latents,
        prepared,
        continuation,
        asked_seconds,
        request.replace(seed=seed) if seed is not None else request,
        sparsity,
    )


def with_prompt(request: H3Request, prompt: str) -> H3Request:
    """The same prepared request made from another prompt (a planner's rewrite): the text is the one thing the
    prompt decides, so nothing is decoded again. A request with its own `prompts` keeps them (they, not `prompt`, are
    what its windows read); otherwise every window of a continuation takes the new prompt."""
    spec = request.spec.replace(prompt=prompt) if request.spec is not None else None
    if request.spec is not None and request.spec.prompts is not None:
        return replace(request, spec=spec)
    continuation = request.continuation
    if continuation is not None:
        continuation = replace(continuation, prompts=(prompt,) * continuation.num_windows)
    return replace(request, prompt=prompt, continuation=continuation, spec=spec)


def checkpoint_shifts(checkpoint: H3Checkpoint) -> tuple[float, float]:
    """(video, audio) shifts of the checkpoint's `scheduler/` and `audio_scheduler/` configs (12 and 3 when a
    folder or its config is missing)."""
    shifts = []
    for name, default in (("scheduler", VIDEO_SHIFT), ("audio_scheduler", AUDIO_SHIFT)):
        folder = checkpoint.components.get(name)
        shifts.append(default if folder is None else read_shift(folder, default))
    return shifts[0], shifts[1]


def checkpoint_student(checkpoint: H3Checkpoint) -> StudentContract | None:
    """The FastH3 contract of a checkpoint (`fasth3.read_student_contract`) from its files alone, before any weight
    loads: whether `transformer/` holds attention gates is read from its weight index or file headers."""
    folder = checkpoint.components.get("transformer")
    gated = folder is not None and Path(folder).is_dir() and has_gates(folder)
    video_shift, audio_shift = checkpoint_shifts(checkpoint)
    return read_student_contract(checkpoint.root, gated=gated, video_shift=video_shift, audio_shift=audio_shift)


def read_transformer_config(checkpoint: H3Checkpoint) -> H3TransformerConfig:
    """The transformer's config from `transformer/config.json` (or `transformer_ref/`'s, same architecture), without
    loading any weights."""
    name = (
        "transformer"
        if "transformer" in checkpoint.components or "transformer_ref" not in checkpoint.components
        else "transformer_ref"
    )
    return H3TransformerConfig.from_dict(read_json(checkpoint.folder(name) / "config.json"))


def packed_rows(request: H3Request, text_rows: int, patch_size: tuple[int, int, int]) -> int:
    """The length of a request's packed sequence: `text_rows` (the prompt's tokens; the vision blocks keyframes and
    references add to the text are not counted), conditioning rows (keyframes, visual references and their sound),
    both audio channels and the video rows."""
    _, ph, pw = patch_size
    shape = request.shape
    frame_rows = (shape.latent_height // ph) * (shape.latent_width // pw)
    rows = text_rows + 2 * shape.num_audio_latents + shape.num_latent_frames * frame_rows
    rows += len(request.keyframes) * frame_rows
    for reference in request.references:
        if reference.kind != "audio":
            height, width = reference.visual_size
            rows += reference.num_latent_frames * (height // 16 // ph) * (width // 16 // pw)
        if reference.has_audio:
            rows += 2 * round(reference.audio.shape[-1] / 800)
    return rows


def activation_bytes(rows: int, config: H3TransformerConfig, step_cache: bool = False) -> int:
    """GPU memory one transformer forward's activations take over `rows` packed rows (bf16), estimated as the
    larger of the two phases of a fused block: attention (residual, its norm, q / k / v, the rotated q / k and the
    attention output: 2 x hidden + 6 x heads x head_dim values per row) and the SwiGLU (residual, its norm, the
    up-projection and its activation: 2 x hidden + 3 x ffn_dim). The step cache (quality high) keeps block 0's
    residual and a copy of its output through the other blocks: 2 x hidden more."""
    inner = config.num_attention_heads * config.attention_head_dim
    per_row = 2 * max(2 * config.hidden_size + 6 * inner, 2 * config.hidden_size + 3 * config.ffn_dim)
    if step_cache:
        per_row += 2 * 2 * config.hidden_size
    return rows * per_row


def check_activation_budget(
    request: H3Request, text_rows: int, config: H3TransformerConfig, budget_bytes: int | None, step_cache: bool = False
) -> None:
    """Refuse, before any model work, a request whose activations would not fit what the GPU budget leaves them
    (`budget_bytes`, layer-wise offload's activation share; None: no declared budget)."""
    if budget_bytes is None:
        return
    rows = packed_rows(request, text_rows, config.patch_size)
    needed = activation_bytes(rows, config, step_cache)
    if needed > budget_bytes:
        raise RequestError(
            f"this request packs {rows:,} rows, whose activations need about {needed / 2**30:.1f} GiB of GPU memory, "
            f"more than the {budget_bytes / 2**30:.1f} GiB the GPU budget (gpu_memory) leaves them: ask for fewer "
            "seconds or a smaller canvas, or raise gpu_memory.",
            "seconds",
        )
