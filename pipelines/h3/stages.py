"""The stages of one clip before decoding, each a function with explicit inputs and outputs: encode the text, draw
the noise, encode the conditions, pack the sequence, denoise. `H3Pipeline.run` composes them for a plain request and
`long_video.py` per window; `decode_stages.py` holds what follows (decode video and audio, write the MP4).

Every stage takes `report(stage, step, total)` and calls it when it starts (`step` 0), before each unit of work
inside it (text encoder layers, VAE blocks, denoising steps) and when it ends (`step == total`); an exception the
callback raises stops the stage there.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from h3gen.kernels.vsa_h3 import SparsePlan
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.packing import (
    PackedLayout,
    ReferenceBlock,
    build_layout,
    build_ref2va_layout,
    patchify_video,
    row_timesteps,
    unpatchify_video,
)
from h3gen.pipelines.h3.preview import PreviewMaker
from h3gen.pipelines.h3.progress import checkpoints
from h3gen.pipelines.h3.request import KEYFRAME_NOISE_AUG, H3Request
from h3gen.pipelines.h3.schedules import noise_to
from h3gen.pipelines.h3.sparse_attention import packed_geometry
from h3gen.pipelines.h3.step_cache import step_cache
from h3gen.pipelines.h3.step_cache_config import StepCacheConfig
from h3gen.pipelines.h3.text_encoder import TextConditioning
from h3gen.pipelines.h3.vae import (
    audio_encoder_units,
    encode_frames,
    encode_keyframe,
    encode_sound,
    video_encoder_units,
)

ProgressCallback = Callable[[str, int, int], None]


@dataclass
class Components:
    """What the stages around the transformer run on: the text encoder, the video and audio VAEs, the device the
    work happens on, the transformer's config (both partitions share it) and the stage offload mode ("none":
    everything stays on the device; otherwise a stage's module is brought to the device for the stage)."""

    text_encoder: object
    vae: object
    audio_vae: object
    device: torch.device
    config: object
    offload: str = "none"

    @contextmanager
    def on_device(self, *modules):
        """With stage offload, bring `modules` to the device for one stage and send them back to the host after."""
        if self.offload == "none":
            yield
            return
        for module in modules:
            module.to(self.device)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @property
    def sample_rate(self) -> int:
        """The audio VAE's sample rate (Hz)."""
        return int(self.audio_vae.config.sampling_rate)


@dataclass
class Noise:
    """A request's initial noise: one draw per keyframe or visual reference (its latent shape), video latents
    `(1, C, F, h, w)`, audio rows `(2A, C)`; float32 on the device."""

    condition: list[torch.Tensor]
    video: torch.Tensor
    audio_rows: torch.Tensor


@dataclass
class InitialRows:
    """The packed rows the denoising loop starts from: video `[conditions | noise]` `(rows, C * patch)` and audio
    `[conditions | noise]` `(rows, C)`, float32; ref2va's reference blocks (None for t2va / fl2va)."""

    video: torch.Tensor
    audio: torch.Tensor
    blocks: list[ReferenceBlock] | None = None


@dataclass
class Denoised:
    """What the loop made: video latents `(1, C, F, h, w)`, audio latents `(2, C, A)`, the forwards (0-based) the
    step cache skipped and the number of forwards."""

    video: torch.Tensor
    audio: torch.Tensor
    cached_steps: list[int]
    forwards: int


def encode_text(parts: Components, request: H3Request, report: ProgressCallback) -> TextConditioning:
    """Stage `encode_text`: the prompt (with keyframes or references) through Qwen3-VL; embeddings `(1, T, D)` on
    the device and each token's tag."""
    report("encode_text", 0, 1)
    layers = parts.text_encoder.model.model.language_model.layers
    with parts.on_device(parts.text_encoder.model), checkpoints(layers, lambda: report("encode_text", 0, 1)):
        text = parts.text_encoder.encode(request.prompt, request.keyframes, request.references)
    report("encode_text", 1, 1)
    return TextConditioning(text.embeds.to(parts.device), text.token_tags)


def draw(parts: Components, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """Standard normal noise of `shape`, float32 on the device. Drawn on the generator's device, then moved: a CPU
    generator gives the same noise on every device."""
    return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(parts.device)


def draw_noise(parts: Components, request: H3Request) -> Noise:
    """All of a request's noise, in the reference's order from its one generator: one draw per keyframe
    `(1, C, 1, h, w)` or per image / video reference (its own latent shape), then video `(1, C, F, h, w)`, then
    audio in row layout `(2A, C)`. A request's own `latents` / `audio_latents` skip their draw."""
    shape, cfg = request.shape, parts.config
    frame = (1, cfg.in_channels, 1, shape.latent_height, shape.latent_width)
    condition = [draw(parts, frame, request.generator) for _ in request.keyframes]
    for reference in request.references:
        if reference.kind != "audio":
            height, width = reference.visual_size
            latent = (
                1,
                cfg.in_channels,
                reference.num_latent_frames,
                height // geometry.SPATIAL_COMPRESSION,
                width // geometry.SPATIAL_COMPRESSION,
            )
            condition.append(draw(parts, latent, request.generator))
    video = request.latents
    if video is None:
        video = draw(
            parts,
            (1, cfg.in_channels, shape.num_latent_frames, shape.latent_height, shape.latent_width),
            request.generator,
        )
    if request.audio_latents is None:
        audio_rows = draw(parts, (shape.num_audio_latents * 2, cfg.audio_in_channels), request.generator)
    else:
        audio_rows = request.audio_latents.permute(0, 2, 1).reshape(-1, cfg.audio_in_channels)
    return Noise(condition, video.to(parts.device, torch.float32), audio_rows.to(parts.device, torch.float32))


def _keyframe_rows(parts: Components, request: H3Request, noise: Noise, report: ProgressCallback):
    """Encode each keyframe, noise it to t = 0.999 with its draw, pack into rows (packed order)."""
    rows, total = [], len(request.keyframes)
    for index, (keyframe, noise_draw) in enumerate(zip(request.keyframes, noise.condition, strict=True)):
        report("encode_conditions", index, total)
        with checkpoints(video_encoder_units(parts.vae), lambda index=index: report("encode_conditions", index, total)):
            latents = encode_keyframe(parts.vae, keyframe).to(parts.device)
        rows.append(patchify_video(noise_to(latents, KEYFRAME_NOISE_AUG, noise_draw), parts.config.patch_size))
        report("encode_conditions", index + 1, total)
    return torch.cat(rows)


def _reference_rows(parts: Components, request: H3Request, noise: Noise, report: ProgressCallback):
    """Encode the references in order: pictures through the video VAE (noised to t = 0.999 with their draw, as
    keyframes), sound through the audio VAE (clean, never noised). Returns (video rows or None, audio rows or None,
    the layout's blocks)."""
    video_rows, audio_rows, blocks = [], [], []
    draws = iter(noise.condition)
    total = len(request.references)
    for index, reference in enumerate(request.references):
        report("encode_conditions", index, total)

        def check(index=index):
            report("encode_conditions", index, total)

        grid = (0, 0, 0)
        if reference.kind != "audio":
            pixels = reference.frames if reference.kind == "video" else np.array(reference.image)[None]
            with parts.on_device(parts.vae), checkpoints(video_encoder_units(parts.vae), check):
                latents = encode_frames(parts.vae, pixels[: reference.num_encoded_frames]).to(parts.device)
            grid = tuple(latents.shape[2:5])
            video_rows.append(
                patchify_video(noise_to(latents, KEYFRAME_NOISE_AUG, next(draws)), parts.config.patch_size)
            )
        sound = 0
        if reference.has_audio:
            with parts.on_device(parts.audio_vae), checkpoints(audio_encoder_units(parts.audio_vae), check):
                audio_rows.append(encode_sound(parts.audio_vae, reference.audio).to(parts.device))
            sound = audio_rows[-1].shape[0] // 2
        blocks.append(ReferenceBlock(reference.kind, *grid, audio_latents=sound))
        report("encode_conditions", index + 1, total)
    return (torch.cat(video_rows) if video_rows else None, torch.cat(audio_rows) if audio_rows else None, blocks)


def encode_conditions(parts: Components, request: H3Request, noise: Noise, report: ProgressCallback) -> InitialRows:
    """Stage `encode_conditions`: keyframes (fl2va) or references (ref2va) encoded and packed in front of the noise
    rows the loop starts from (t2va: the noise rows alone)."""
    blocks, condition_rows, audio_condition = None, None, None
    if request.references:
        condition_rows, audio_condition, blocks = _reference_rows(parts, request, noise, report)
    elif request.keyframes:
        with parts.on_device(parts.vae):
            condition_rows = _keyframe_rows(parts, request, noise, report)
    video_rows = patchify_video(noise.video, parts.config.patch_size)
    if condition_rows is not None:
        video_rows = torch.cat([condition_rows, video_rows])
    audio_rows = noise.audio_rows.clone()
    if audio_condition is not None:
        audio_rows = torch.cat([audio_condition, audio_rows])
    return InitialRows(video_rows, audio_rows, blocks)


def pack(
    request: H3Request,
    text: TextConditioning,
    blocks: list[ReferenceBlock] | None,
    patch_size: tuple[int, int, int],
    *,
    media_offset: float = 0.0,
    guide_frames: int = 0,
    guide_audio_latents: int = 0,
) -> PackedLayout:
    """The packed layout of a request's sequence (`packing.py`): text, conditions (keyframes, or ref2va's reference
    `blocks`), audio and video rows with their positions. A window of a long clip passes its media offset on the
    clip's timeline and the guide rows it carries (`long_video.py`)."""
    shape = request.shape
    extra = dict(
        patch_size=patch_size,
        media_offset=media_offset,
        guide_frames=guide_frames,
        guide_audio_latents=guide_audio_latents,
    )
    if request.task == "ref2va":
        return build_ref2va_layout(
            text.token_tags,
            blocks,
            shape.num_latent_frames,
            shape.latent_height,
            shape.latent_width,
            shape.num_audio_latents,
            **extra,
        )
    return build_layout(
        text.token_tags,
        shape.num_latent_frames,
        shape.latent_height,
        shape.latent_width,
        shape.num_audio_latents,
        keyframe_anchors=request.anchors,
        **extra,
    )


@torch.no_grad()
def sparse_plans(
    request: H3Request, layout: PackedLayout, cond: int, cond_audio: int, patch_size, device: torch.device
) -> list:
    """Each forward's `SparsePlan` (None: dense) for this packed sequence: its tile geometry is built once here."""
    if request.sparsity is None:
        return [None] * request.sampling.forwards
    shape = request.shape
    _, ph, pw = patch_size
    grid = (shape.num_latent_frames, shape.latent_height // ph, shape.latent_width // pw)
    tiles = packed_geometry(layout, cond, cond_audio, grid).to(device)
    return [SparsePlan(tiles, value) for value in request.sparsity]


@contextmanager
def sparse_attention(transformer):
    """The model's `SparseSwitch` for the forwards of this block; dense again after it, whatever happens."""
    switch = transformer.sparse
    try:
        yield switch
    finally:
        switch.plan = None


def denoise(
    transformer,
    request: H3Request,
    text: TextConditioning,
    rows: InitialRows,
    layout: PackedLayout,
    report: ProgressCallback,
    *,
    device: torch.device,
    tier: str,
    cache: StepCacheConfig | None = None,
    preview: PreviewMaker | None = None,
) -> Denoised:
    """Stage `denoise`: one transformer forward per step; video and audio rows step their own schedules in place;
    conditioning rows (keyframes, references, a window's guide) are never written. With `cache`, the first-block
    step cache decides per forward whether blocks 1..N-1 run. Outside the exact tier every block's AdaLN table for
    the whole request is computed up front. With `preview`, the loop hands it the prediction of the clean video
    latents after the forwards it asks for (`preview.py`)."""
    shape = request.shape
    video_schedule, audio_schedule = request.sampling.schedules()
    total = len(video_schedule)
    report("denoise", 0, total)
    on_device = layout.to(device)
    cond, cond_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
    plan = []  # per step: the distinct timesteps and every row's index into them
    for i in range(total):
        video_t = float(video_schedule.timesteps[i])
        timestep, indices = row_timesteps(
            layout, video_t, float(audio_schedule.timesteps[i]), max(video_t, KEYFRAME_NOISE_AUG)
        )
        plan.append((timestep.to(device), indices.to(device)))
    tables = transformer.precompute_adaln([t for t, _ in plan]) if tier != "exact" else None
    video_rows, audio_rows = rows.video, rows.audio
    patch_size = transformer.config.patch_size
    if preview is not None:
        preview.begin()
    sparse = sparse_plans(request, layout, cond, cond_audio, patch_size, device)
    with (
        step_cache(transformer, cache, total) if cache is not None else nullcontext() as cached,
        sparse_attention(transformer) as switch,
    ):
        for i, (timestep, timestep_indices) in enumerate(plan):
            switch.plan = sparse[i]
            video_v, audio_v = transformer(
                hidden_states=video_rows[None],
                audio_hidden_states=audio_rows[None],
                encoder_hidden_states=text.embeds,
                timestep=timestep,
                timestep_indices=timestep_indices,
                token_tags=on_device.token_tags,
                position_ids=on_device.position_ids,
                video_indices=on_device.video_indices,
                audio_indices=on_device.audio_indices,
                text_indices=on_device.text_indices,
                return_dict=False,
                adaln_tables=tables,
                step=i,
            )
            clean = None
            if preview is not None and preview.due(i + 1, total):  # x0 = x_t + sigma * v, before the step
                sigma = 1.0 - video_schedule.timesteps[i].to(video_rows.device, video_rows.dtype)
                clean = video_rows[cond:] + sigma * video_v[0, cond:].float()
            video_rows[cond:] = video_schedule.step(i, video_v[0, cond:].float(), video_rows[cond:])
            audio_rows[cond_audio:] = audio_schedule.step(i, audio_v[0, cond_audio:].float(), audio_rows[cond_audio:])
            report("denoise", i + 1, total)
            if clean is not None:
                shape_args = (shape.num_latent_frames, shape.latent_height, shape.latent_width, patch_size)
                preview.make(unpatchify_video(clean, *shape_args), i + 1, total)
                del clean
    latents = unpatchify_video(
        video_rows[cond:], shape.num_latent_frames, shape.latent_height, shape.latent_width, patch_size
    )
    audio = audio_rows[cond_audio:].reshape(2, shape.num_audio_latents, -1).permute(0, 2, 1).contiguous()
    return Denoised(latents, audio, cached.cached_steps if cached is not None else [], total)
