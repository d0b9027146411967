"""`H3Pipeline`: prompt (and keyframes or references) -> video frames + stereo audio, identical to diffusers'
MiniMax-H3 blocks.

Stages, each handing one value to the next:
  validate -> encode text -> draw noise -> encode conditions (keyframes, or references: pictures through the video
  VAE, sound through the audio VAE) -> denoise (one transformer forward per step, two schedules) -> decode video ->
  decode audio.
t2va and fl2va run on `transformer/`, ref2va on its own partition `transformer_ref/` (same architecture).
`callback(stage, step, total)` reports progress from outside the stages; they know nothing about HTTP or bars. Each
stage reports when it starts (`step` 0), at points inside it (before each unit of work of its long calls: text
encoder layers, VAE blocks), and when it ends (`step == total`); an exception the callback raises stops the call
there, which is how a job is cancelled within a fraction of a second in any stage.
"""

import logging
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from h3gen.errors import RequestError
from h3gen.kernels.attention import resolve_backend
from h3gen.media import BackgroundEncode, MediaInfo, Mp4Writer, rgb_to_yuv420, write_mp4
from h3gen.offload import plan_placement
from h3gen.options import RunOptions, base_tier, uses_step_cache
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.adapter_memory import DeviceMemory, tracks_device_memory
from h3gen.pipelines.h3.checkpoint import REQUIRED, H3Checkpoint, resolve_workflow
from h3gen.pipelines.h3.continuation import DEFAULT_MAX_SECONDS
from h3gen.pipelines.h3.long_video import largest_window, run_continuation
from h3gen.pipelines.h3.lora_registry import (
    DEFAULT_MAX_CPU_LORAS,
    LoraRegistry,
    activate,
    active_loras,
    check_device_budget,
    check_targets,
    fp8_layers,
    lora_budget_bytes,
    lora_device_bytes,
    merge_into,
)
from h3gen.pipelines.h3.packing import (
    ReferenceBlock,
    build_layout,
    build_ref2va_layout,
    patchify_video,
    row_timesteps,
    unpatchify_video,
)
from h3gen.pipelines.h3.progress import checkpoints as _checkpoints
from h3gen.pipelines.h3.recipes import recipe_for
from h3gen.pipelines.h3.references import AudioReference, ImageReference, VideoReference
from h3gen.pipelines.h3.request import (
    KEYFRAME_NOISE_AUG,
    H3Request,
    check_activation_budget,
    prepare_request,
    read_transformer_config,
)
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT, noise_to, read_shift
from h3gen.pipelines.h3.step_cache import step_cache
from h3gen.pipelines.h3.step_cache_config import StepCacheConfig
from h3gen.pipelines.h3.text_encoder import H3TextEncoder, TextConditioning
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.vae import (
    audio_decoder_units,
    audio_encoder_units,
    decode_audio,
    decode_video,
    encode_frames,
    encode_keyframe,
    encode_sound,
    load_audio_vae,
    load_video_vae,
    video_decoder_units,
    video_encoder_units,
)
from h3gen.pipelines.h3.video_decode import to_fp8_decoder

logger = logging.getLogger(__name__)

__all__ = ["AudioReference", "H3Output", "H3Pipeline", "ImageReference", "VideoReference"]

ProgressCallback = Callable[[str, int, int], None]


@dataclass
class Noise:
    """A request's initial noise: one draw per keyframe or visual reference (its latent shape), video latents
    `(1, C, F, h, w)`, audio rows `(2A, C)`."""

    condition: list[torch.Tensor]
    video: torch.Tensor
    audio_rows: torch.Tensor


@dataclass
class H3Output:
    """A generated clip. `video` `(F, H, W, 3)` float32 in [0, 1]; `audio` `(2, samples)` float32 in [-1, 1]
    (both None for a call with `decode=False`, and for a clip over 15 s, which is only in the MP4 at `path`)."""

    video: np.ndarray | None
    audio: np.ndarray | None
    fps: int = geometry.FPS
    sample_rate: int = 32000
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    planned_prompt: str | None = None  # the planner's prompt the clip was made from (a call with plan=True)
    path: str | None = None  # the MP4 a call with `output_path` wrote (its `video` is then None)
    media: MediaInfo | None = None  # what decoding that MP4 back found
    windows: int = 1  # how many windows the clip was made of (over 15 s: more than one)
    cached_steps: list[int] = field(default_factory=list)  # forwards (0-based) the step cache skipped (quality high)
    num_forwards: int = 0  # transformer forwards of the request (num_inference_steps - 1)
    loras: list[tuple[str, float]] = field(default_factory=list)  # adapters applied (name, scale), merged ones first
    # How it was sampled: num_inference_steps (sigma points), forwards (transformer forwards), video_shift,
    # audio_shift, recipe (the few-step recipe followed, or None); see `recipes.Sampling.describe`.
    sampling: dict = field(default_factory=dict)

    @property
    def computed_steps(self) -> list[int]:
        """Forwards that ran every block."""
        cached = set(self.cached_steps)
        return [step for step in range(self.num_forwards) if step not in cached]

    @property
    def forwards(self) -> int | None:
        """Transformer forwards the clip took."""
        return self.sampling.get("forwards")

    @property
    def num_inference_steps(self) -> int | None:
        """Sigma grid points, diffusers' count (forwards + 1)."""
        return self.sampling.get("num_inference_steps")

    def save(self, path, audio_sample_rate: int | None = None, progress: Callable[[int, int], None] | None = None):
        """Write an MP4 (H.264 + AAC stereo at `audio_sample_rate`, default 32000) and verify it decodes back.
        `progress(done, total)` runs per frame written and read back (see `write_mp4`). Returns the decoded file's
        `MediaInfo`."""
        if self.video is None:
            raise ValueError(
                "this output holds no frames: it was generated with decode=False or written to output_path already."
            )
        return write_mp4(
            path,
            self.video,
            self.audio,
            fps=self.fps,
            sample_rate=self.sample_rate,
            audio_sample_rate=audio_sample_rate,
            progress=progress,
        )


def _check_attention(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Refuse, before loading, an attention backend that cannot run here (not installed, or not for these heads)."""
    try:
        resolve_backend(backend, device, dtype, head_dim)
    except ValueError as error:
        raise RequestError(f"attention {backend} cannot run here: {error}", "attention") from None


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class H3Pipeline:
    """MiniMax-H3 text(+keyframes or references)-to-video-and-audio. Build with `from_pretrained`.

    `transformer` serves t2va / fl2va and `transformer_ref` ref2va; either may be None when the pipeline was loaded
    for the other task only.
    """

    def __init__(
        self,
        transformer,
        text_encoder,
        vae,
        audio_vae,
        *,
        checkpoint: H3Checkpoint,
        device,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        workflow: str | None = None,
        quality: str | None = None,
        offload: str | None = None,
        transformer_ref=None,
        planner=None,
        options: RunOptions | None = None,
        max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
        lora_gpu_memory=None,
    ):
        if transformer is None and transformer_ref is None:
            raise ValueError("H3Pipeline needs a transformer, a transformer_ref, or both.")
        self.options = RunOptions.merged(options, workflow=workflow, quality=quality, offload=offload)
        self.transformer = transformer
        self.transformer_ref = transformer_ref
        self.text_encoder = text_encoder
        self.vae = vae
        self.audio_vae = audio_vae
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        self.video_shift = video_shift
        self.audio_shift = audio_shift
        self.workflow = self.options.workflow
        self.offload = self.options.offload
        self.quality = self.options.quality
        # Optional prompt planner (`h3gen.pipelines.k3.planner`): `plan(prompt, image=...) -> PlannedPrompt`.
        self.planner = planner
        # Longest clip a call may ask for (over 15 s it is made in windows); a server raises it up to 300 s.
        self.max_seconds = DEFAULT_MAX_SECONDS
        for model in self._transformers():
            set_quality(model, self.quality, attention=self.options.attention_for(self.quality))
        if base_tier(self.quality) == "fast" and vae is not None:
            to_fp8_decoder(vae)
        # Adapters (`load_lora`, `loras=`): a host LRU of `max_cpu_loras`; `lora_gpu_memory` caps what a request's
        # adapters may take on the device (default: what the device has free, less a margin).
        self.loras = LoraRegistry(
            max_cpu_loras,
            head_dim=self.config.attention_head_dim,
            check=lambda lora: check_targets(self._transformers()[0], lora),
            pin=self.device.type == "cuda",
        )
        self.lora_gpu_memory = lora_budget_bytes(lora_gpu_memory)
        self.device_memory = DeviceMemory(
            self.device,
            held=lambda: {
                self._partition_of(model): active.nbytes
                for model in self._transformers()
                if (active := active_loras(model)) is not None
            },
        )
        self.merged_loras: dict[str, list[tuple[str, float]]] = {}  # partition -> adapters merged into it

    def _transformers(self) -> list:
        return [model for model in (self.transformer, self.transformer_ref) if model is not None]

    @property
    def config(self):
        """The transformer architecture (both partitions share it)."""
        return self._transformers()[0].config

    def _transformer_for(self, task: str):
        """The partition that serves `task`, or a `RequestError` saying how to load it."""
        model = self.transformer_ref if task == "ref2va" else self.transformer
        if model is None:
            need = "workflow='ref2va' or 'all'" if task == "ref2va" else "workflow='t2va', 'fl2va' or 'all'"
            part = "transformer_ref" if task == "ref2va" else "transformer"
            raise RequestError(
                f"this pipeline was loaded without its {part}/ partition, which {task} needs; load it with {need}.",
                "references" if task == "ref2va" else "task",
            )
        return model

    @classmethod
    def from_pretrained(
        cls,
        path,
        device=None,
        torch_dtype: torch.dtype = torch.bfloat16,
        workflow: str | None = None,
        quality: str | None = None,
        parallel=None,
        offload: str | None = None,
        gpu_memory=None,
        prefetch: int | None = None,
        quantization: str | None = None,
        planner=None,
        attention: str | None = None,
        options: RunOptions | None = None,
        max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
        lora_gpu_memory=None,
    ) -> "H3Pipeline":
        """Load every component of a local checkpoint folder in diffusers' layout.

        How it loads and runs is one `RunOptions` (`h3gen.options`): pass `options`, or its fields as keywords
        (`workflow`, `quality`, `offload`, `gpu_memory`, `prefetch`, `quantization`, `attention`); keywords given
        next to `options` replace its fields. An invalid value or combination raises `RequestError` naming the field.

        `torch_dtype` applies to the transformer, the text encoder and the video VAE (their float32 islands stay
        float32); the audio VAE is always float32. `workflow` is "t2va" (default) or "fl2va" (both load the same
        components; fl2va also requires `processor/`), "ref2va" (loads `transformer_ref/` instead of
        `transformer/`), "all" (every task the checkpoint has the components for; both partitions when it holds
        both, which then share `gpu_memory` under layer-wise offload) or "auto" (all when both partitions are small
        next to the device's memory, else fl2va). A missing component raises `CheckpointError` naming it. `quality`
        is the default tier (`exact`, `lossless` (default), `fast`, `high` or `fast+high`, see `tiers.py`); `fast`
        quantizes the transformer's block GEMMs to FP8 at load, and only a pipeline loaded with `fast` or
        `fast+high` serves `fast` and `fast+high` requests; `high` adds the step cache per call (`step_cache.py`).
        `parallel` (an `h3gen.parallel.ParallelState` of an initialised process group) splits the transformer over
        the ranks (tensor parallel x Ulysses); the text encoder and the VAEs are replicated. Every rank must then
        make the same calls with the same seed. `offload`: "none" (default, everything on the device), "stage" or
        "layerwise" (with `gpu_memory`, e.g. "30GiB", and `prefetch`, default 2), placed by `h3gen.offload`'s
        `plan_placement`. `quantization="mxfp4"` stores the transformer's block linears as MXFP4, quantized one
        tensor at a time while loading (a checkpoint saved that way loads as such). `attention` names an attention
        backend for the lossless and fast tiers (checked against the device before loading). `planner` (a
        `LocalPlanner` or `RemotePlanner` from `h3gen.pipelines.k3.planner`) serves calls with `plan=True`.
        `max_cpu_loras` adapters stay converted in host memory (see `load_lora`); `lora_gpu_memory` ("4GiB") caps
        the device memory a request's adapters may take.
        """
        options = RunOptions.merged(
            options,
            workflow=workflow,
            quality=quality,
            offload=offload,
            gpu_memory=gpu_memory,
            prefetch=prefetch,
            quantization=quantization,
            attention=attention,
        )
        device = _resolve_device(device)
        checkpoint = H3Checkpoint.open(path)
        options = replace(options, workflow=resolve_workflow(checkpoint, options.workflow, device))
        tasks = checkpoint.tasks() if options.workflow == "all" else (options.workflow,)
        for task in tasks or ("t2va",):  # an empty "all" reports what t2va misses
            checkpoint.require(task)
        partitions = [
            name for name in ("transformer", "transformer_ref") if any(name in REQUIRED[task] for task in tasks)
        ]
        if options.attention is not None:
            _check_attention(
                options.attention, device, torch_dtype, read_transformer_config(checkpoint).attention_head_dim
            )
        folders = {name: checkpoint.folder(name) for name in (*partitions, "text_encoder", "vae", "audio_vae")}
        placement = plan_placement(options, device, folders, partitions=len(partitions), parallel=parallel)
        loaded = {}
        for name in partitions:
            store = placement.host_store(name)
            loaded[name] = H3Transformer.from_pretrained(
                folders[name],
                torch_dtype=torch_dtype,
                device=placement.transformer_device,
                parallel=parallel,
                quantization=options.quantization,
                skip_prefixes=placement.skip_prefixes(store),
            )
            placement.offload_transformer(loaded[name], store)
        text_encoder = H3TextEncoder.from_pretrained(
            folders["text_encoder"],
            checkpoint.folder("tokenizer"),
            checkpoint.components.get("processor"),
            dtype=torch_dtype,
            device=placement.stage_device,
        )
        placement.offload_text_encoder(text_encoder.model.model.language_model.layers)
        vae = load_video_vae(folders["vae"], dtype=torch_dtype, device=placement.stage_device)
        audio_vae = load_audio_vae(folders["audio_vae"], device=placement.stage_device)
        return cls(
            loaded.get("transformer"),
            text_encoder,
            vae,
            audio_vae,
            checkpoint=checkpoint,
            device=device,
            video_shift=read_shift(checkpoint.folder("scheduler"), VIDEO_SHIFT),
            audio_shift=read_shift(checkpoint.folder("audio_scheduler"), AUDIO_SHIFT),
            transformer_ref=loaded.get("transformer_ref"),
            planner=planner,
            options=options,
            max_cpu_loras=max_cpu_loras,
            lora_gpu_memory=lora_gpu_memory,
        )

    def validate(self, prompt, *, step_cache: bool = False, lora_files: list | None = None, **kwargs) -> H3Request:
        """Check a request against this pipeline's checkpoint (see `prepare_request`; shifts left unset are this
        pipeline's), its adapters (`lora_files`, `LoraFile`s read by `lora_formats.read_lora`) against their GPU
        budget and, under layer-wise offload, its activations (with `step_cache`, the step cache's too) against the
        GPU budget (a clip over 15 s: its largest window's), before any model work."""
        kwargs.setdefault("max_seconds", self.max_seconds)
        request = prepare_request(
            self.checkpoint, self.config, prompt, default_shifts=(self.video_shift, self.audio_shift), **kwargs
        )
        if lora_files:
            self._check_lora_budget(lora_files, request.task)
        budget = getattr(self._transformer_for(request.task), "activation_budget_bytes", None)
        if budget is not None:
            sized = request if request.continuation is None else largest_window(request)
            check_activation_budget(
                sized, len(self.text_encoder.tokenize(sized.prompt)), self.config, budget, step_cache=step_cache
            )
        return request

    # ------------------------------------------------------------------ adapters

    def load_lora(
        self, path, name: str | None = None, alpha: float | None = None, *, merge: bool = False, scale: float = 1.0
    ) -> str:
        """Register the LoRA file at `path` (a `.safetensors` file in any format `lora_formats` reads) under `name`
        (default: the file's stem) and return the name, which requests then give in `loras=`. The file is checked
        against the transformer (every key converted, every shape fitting) and held converted in host memory while
        it is among the `max_cpu_loras` most recently used. `alpha` replaces the file's alpha as a uniform network
        alpha (each module scaled by alpha / its rank).

        `merge=True` (a server with one fixed adapter) instead adds `scale` times the update into the dense weights
        for good, refused when bf16 rounding would lose more than half of it on any module (then apply it unmerged)
        and on FP8 / MXFP4 weights. Raises `RequestError` (field "loras", "alpha" or "merge")."""
        if merge and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
            raise RequestError(f"LoRA merge scale must be a finite number (got {scale!r}).", "merge")
        name = self.loras.register(path, name, alpha)
        if merge:
            adapter = self.loras.adapter(name)
            for partition, factors in adapter.factors.items():
                model = (
                    self.transformer_ref
                    if partition == "transformer_ref"
                    else (self.transformer if self.transformer is not None else self.transformer_ref)
                )
                if model is None:
                    raise RequestError(
                        f"LoRA {name} holds {partition} layers, which this pipeline did not load.", "merge"
                    )
                merge_into(model, name, factors, scale)
                self.merged_loras.setdefault(self._partition_of(model), []).append((name, float(scale)))
        return name

    def _recipes(self, loras, references) -> list:
        """The few-step recipes (`recipes.Recipe`) of a call's adapters and of those merged into the partition it
        runs on, which its step count, shifts and task must agree with."""
        partition = "transformer_ref" if references is not None else "transformer"
        files = [adapter.file for adapter, _ in self.loras.resolve(loras)]
        files += [self.loras.adapter(name).file for name, _ in self.merged_loras.get(partition, [])]
        return [recipe for recipe in (recipe_for(lora.path.name, lora.metadata) for lora in files) if recipe]

    def _partition_of(self, model) -> str:
        return "transformer_ref" if model is self.transformer_ref else "transformer"

    def _applied_loras(self, model, adapters) -> list[tuple[str, float]]:
        """`(name, scale)` of the adapters a call ran with: those merged into `model` first, then its own."""
        return self.merged_loras.get(self._partition_of(model), []) + [(a.name, scale) for a, scale in adapters]

    def _request_loras(self, loras, task: str) -> list:
        """A request's adapters `[(Adapter, scale)]`, refused before any model work when their device copies would
        not fit the adapters' GPU budget."""
        adapters = self.loras.resolve(loras)
        if adapters:
            self._check_lora_budget([adapter.file for adapter, _ in adapters], task)
        return adapters

    def _check_lora_budget(self, files: list, task: str) -> None:
        """Refuse adapters (`LoraFile`s) whose device copies for `task` exceed `lora_gpu_memory`, or without it the
        device memory available to them (`DeviceMemory`) less a margin."""
        model = self._transformer_for(task)
        fp8 = fp8_layers(model)
        extended = getattr(model, "offload", None) is None  # `activate` extends no weight under layer-wise offload
        need = sum(lora_device_bytes(lora, task, model.dtype.itemsize, fp8, extended) for lora in files)
        check_device_budget(
            need,
            [lora.name for lora in files],
            self.lora_gpu_memory,
            self.device_memory.available(self._partition_of(model)),
        )

    # ------------------------------------------------------------------ stages

    def _draw(self, shape, generator: torch.Generator) -> torch.Tensor:
        # Drawn on the generator's device, then moved: a CPU generator gives the same noise on every device.
        return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32).to(self.device)

    def draw_noise(self, request: H3Request) -> Noise:
        """All of a request's noise, in the reference's order from its one generator: one draw per keyframe
        `(1, C, 1, h, w)` or per image / video reference (its own latent shape), then video `(1, C, F, h, w)`, then
        audio in row layout `(2A, C)`. Given `latents` / `audio_latents` skip their draw."""
        shape, cfg = request.shape, self.config
        frame = (1, cfg.in_channels, 1, shape.latent_height, shape.latent_width)
        condition = [self._draw(frame, request.generator) for _ in request.keyframes]
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
                condition.append(self._draw(latent, request.generator))
        video = request.latents
        if video is None:
            video = self._draw(
                (1, cfg.in_channels, shape.num_latent_frames, shape.latent_height, shape.latent_width),
                request.generator,
            )
        if request.audio_latents is None:
            audio_rows = self._draw((shape.num_audio_latents * 2, cfg.audio_in_channels), request.generator)
        else:
            audio_rows = request.audio_latents.permute(0, 2, 1).reshape(-1, cfg.audio_in_channels)
        return Noise(condition, video.to(self.device, torch.float32), audio_rows.to(self.device, torch.float32))

    def initial_noise(self, *, seed: int, **request) -> tuple[torch.Tensor, torch.Tensor]:
        """The `(latents (1, C, F, h, w), audio_latents (2, C, A))` a seed draws for a request (same keyword
        arguments as `__call__`, without the prompt). Passing them back reproduces that seed's output."""
        noise = self.draw_noise(self.validate("noise", seed=seed, **request))
        audio = noise.audio_rows.reshape(2, -1, noise.audio_rows.shape[-1]).permute(0, 2, 1).contiguous()
        return noise.video, audio

    def _condition_rows(self, request: H3Request, noise: Noise, report: ProgressCallback) -> torch.Tensor | None:
        """Encode each keyframe, noise it to t = 0.999 with its draw, pack into rows (packed order)."""
        if not request.keyframes:
            return None
        rows, total = [], len(request.keyframes)
        for index, (keyframe, draw) in enumerate(zip(request.keyframes, noise.condition, strict=True)):
            report("encode_conditions", index, total)
            with _checkpoints(
                video_encoder_units(self.vae), lambda index=index: report("encode_conditions", index, total)
            ):
                latents = encode_keyframe(self.vae, keyframe).to(self.device)
            rows.append(patchify_video(noise_to(latents, KEYFRAME_NOISE_AUG, draw), self.config.patch_size))
            report("encode_conditions", index + 1, len(request.keyframes))
        return torch.cat(rows)

    def _reference_rows(self, request: H3Request, noise: Noise, report: ProgressCallback):
        """Encode the references in order: pictures through the video VAE (noised to t = 0.999 with their draw, as
        keyframes), sound through the audio VAE (clean, never noised). Returns (video rows or None, audio rows or
        None, the layout's blocks)."""
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
                with self._stage(self.vae), _checkpoints(video_encoder_units(self.vae), check):
                    latents = encode_frames(self.vae, pixels[: reference.num_encoded_frames]).to(self.device)
                grid = tuple(latents.shape[2:5])
                video_rows.append(
                    patchify_video(noise_to(latents, KEYFRAME_NOISE_AUG, next(draws)), self.config.patch_size)
                )
            sound = 0
            if reference.has_audio:
                with self._stage(self.audio_vae), _checkpoints(audio_encoder_units(self.audio_vae), check):
                    audio_rows.append(encode_sound(self.audio_vae, reference.audio).to(self.device))
                sound = audio_rows[-1].shape[0] // 2
            blocks.append(ReferenceBlock(reference.kind, *grid, audio_latents=sound))
            report("encode_conditions", index + 1, len(request.references))
        return (torch.cat(video_rows) if video_rows else None, torch.cat(audio_rows) if audio_rows else None, blocks)

    @torch.no_grad()
    def _denoise(
        self,
        request: H3Request,
        text,
        video_rows,
        audio_rows,
        report: ProgressCallback,
        tier: str,
        blocks: list[ReferenceBlock] | None = None,
        cache: StepCacheConfig | None = None,
        layout=None,
        adapters: list | None = None,
    ):
        """The loop: one transformer forward per step; video and audio rows step their own schedules; conditioning
        rows (keyframes, references) are never written. With `cache`, the first-block step cache decides per
        forward whether blocks 1..N-1 run. `layout`: a window's own (`long_video.window_layout`). `adapters`
        (`[(Adapter, scale)]`) are applied unmerged. Returns (video latents, audio latents, cached forward indices,
        number of forwards)."""
        shape = request.shape
        transformer = self._transformer_for(request.task)
        activate(transformer, adapters or [], request.task, self.device)
        video_schedule, audio_schedule = request.sampling.schedules()
        total = len(video_schedule)
        report("denoise", 0, total)
        if layout is None and request.task == "ref2va":
            layout = build_ref2va_layout(
                text.token_tags,
                blocks,
                shape.num_latent_frames,
                shape.latent_height,
                shape.latent_width,
                shape.num_audio_latents,
                patch_size=self.config.patch_size,
            )
        elif layout is None:
            layout = build_layout(
                text.token_tags,
                shape.num_latent_frames,
                shape.latent_height,
                shape.latent_width,
                shape.num_audio_latents,
                patch_size=self.config.patch_size,
                keyframe_anchors=request.anchors,
            )
        on_device = layout.to(self.device)
        cond, cond_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
        plan = []  # per step: the distinct timesteps and every row's index into them
        for i in range(total):
            video_t = float(video_schedule.timesteps[i])
            timestep, indices = row_timesteps(
                layout, video_t, float(audio_schedule.timesteps[i]), max(video_t, KEYFRAME_NOISE_AUG)
            )
            plan.append((timestep.to(self.device), indices.to(self.device)))
        # Outside the exact tier every block's AdaLN table for the whole request is computed up front.
        tables = transformer.precompute_adaln([t for t, _ in plan]) if tier != "exact" else None
        with step_cache(transformer, cache, total) if cache is not None else nullcontext() as cached:
            self._steps(
                transformer,
                plan,
                tables,
                text,
                on_device,
                video_rows,
                audio_rows,
                video_schedule,
                audio_schedule,
                cond,
                cond_audio,
                report,
            )
        latents = unpatchify_video(
            video_rows[cond:], shape.num_latent_frames, shape.latent_height, shape.latent_width, self.config.patch_size
        )
        audio = audio_rows[cond_audio:].reshape(2, shape.num_audio_latents, -1).permute(0, 2, 1).contiguous()
        return latents, audio, (cached.cached_steps if cached is not None else []), total

    @staticmethod
    def _steps(
        transformer,
        plan,
        tables,
        text,
        on_device,
        video_rows,
        audio_rows,
        video_schedule,
        audio_schedule,
        cond: int,
        cond_audio: int,
        report: ProgressCallback,
    ) -> None:
        """The denoising steps, updating `video_rows` / `audio_rows` in place."""
        total = len(plan)
        for i, (timestep, timestep_indices) in enumerate(plan):
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
            video_rows[cond:] = video_schedule.step(i, video_v[0, cond:].float(), video_rows[cond:])
            audio_rows[cond_audio:] = audio_schedule.step(i, audio_v[0, cond_audio:].float(), audio_rows[cond_audio:])
            report("denoise", i + 1, total)

    @contextmanager
    def _stage(self, *modules):
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

    def _tier(self, quality: str | None) -> str:
        """Check a per-call tier (`RunOptions.request_quality`) and switch the transformer to it (exact <->
        lossless is free)."""
        tier = self.options.request_quality(quality)
        for model in self._transformers():
            set_quality(model, tier, attention=self.options.attention_for(tier))
        return tier

    @staticmethod
    def _cache_config(tier: str, cache) -> StepCacheConfig | None:
        """The step cache's validated knobs for a call at `tier` (None: no cache); `cache` only with high tiers."""
        if not uses_step_cache(tier):
            if cache is not None:
                raise RequestError(f"cache applies to quality high or fast+high (this call runs {tier}).", "cache")
            return None
        return StepCacheConfig.from_request(cache)

    # ------------------------------------------------------------------ call

    def _planned_prompt(self, prompt: str, fields: dict, max_tokens: int | None, report: ProgressCallback) -> str:
        """The planner's rewrite of `prompt` (the request is validated first, so a bad one fails before planning;
        the first keyframe goes along when the planner reads images)."""
        if self.planner is None:
            raise RequestError(
                "plan=True needs a pipeline built with a planner (H3Pipeline(..., planner=...)).", "plan"
            )
        self.validate(prompt, **fields)
        keyframe = fields["image"] if getattr(self.planner, "accepts_images", False) else None
        report("plan", 0, 1)
        planned = self.planner.plan(prompt, image=keyframe, max_tokens=max_tokens, seed=fields["seed"]).planned
        report("plan", 1, 1)
        return planned

    def _encode_text(self, request: H3Request, report: ProgressCallback) -> TextConditioning:
        """Stage `encode_text`: the prompt (with keyframes or references) through Qwen3-VL, on this device."""
        report("encode_text", 0, 1)
        layers = self.text_encoder.model.model.language_model.layers
        with self._stage(self.text_encoder.model), _checkpoints(layers, lambda: report("encode_text", 0, 1)):
            text = self.text_encoder.encode(request.prompt, request.keyframes, request.references)
        text = TextConditioning(text.embeds.to(self.device), text.token_tags)
        report("encode_text", 1, 1)
        return text

    def _initial_rows(self, request: H3Request, noise, report: ProgressCallback):
        """Stage `encode_conditions`: the packed video rows `[conditions | noise]` and audio rows `[conditions |
        noise]` the denoising loop starts from, and ref2va's reference blocks (None otherwise)."""
        blocks, audio_condition = None, None
        if request.references:
            condition_rows, audio_condition, blocks = self._reference_rows(request, noise, report)
        else:
            with self._stage(self.vae) if request.keyframes else nullcontext():
                condition_rows = self._condition_rows(request, noise, report)
        video_rows = patchify_video(noise.video, self.config.patch_size)
        if condition_rows is not None:
            video_rows = torch.cat([condition_rows, video_rows])
        audio_rows = noise.audio_rows.clone()
        if audio_condition is not None:
            audio_rows = torch.cat([audio_condition, audio_rows])
        return video_rows, audio_rows, blocks

    def _decode(
        self,
        video_latents: torch.Tensor,
        audio_latents: torch.Tensor,
        decode: bool,
        report: ProgressCallback,
        lap,
        tier: str,
        output_path=None,
        audio_sample_rate: int | None = None,
    ):
        """Stages `decode_video`, `decode_audio` and, with `output_path`, `write_mp4`: (frames `(F, H, W, 3)`
        float32 in [0, 1], stereo `(2, S)` float32, the written file's `MediaInfo` or None). Without `decode` both
        are None (the stages are still reported). With `output_path` the frames go to the file instead of being
        returned (None): converted to yuv420p where they were decoded and encoded on a worker thread while the
        audio decodes."""
        video = audio = media = None
        report("decode_video", 0, 1)
        if decode:

            def check():
                report("decode_video", 0, 1)

            with self._stage(self.vae), _checkpoints(video_decoder_units(self.vae), check):
                video = decode_video(
                    self.vae, video_latents, tier=base_tier(tier), check=check, on_device=output_path is not None
                )
        report("decode_video", 1, 1)
        lap("decode_video")
        writer = encoding = None
        if decode and output_path is not None:
            num_frames, height, width, _ = video.shape
            writer = Mp4Writer(
                output_path,
                width=width,
                height=height,
                fps=geometry.FPS,
                sample_rate=int(self.audio_vae.config.sampling_rate),
                audio_sample_rate=audio_sample_rate,
            )
            encoding = BackgroundEncode(writer, rgb_to_yuv420(video).cpu().numpy())
            video = None
        try:
            report("decode_audio", 0, 1)
            if decode:

                def check():
                    report("decode_audio", 0, 1)

                with self._stage(self.audio_vae), _checkpoints(audio_decoder_units(self.audio_vae), check):
                    audio = decode_audio(self.audio_vae, audio_latents)
            report("decode_audio", 1, 1)
            lap("decode_audio")
            if writer is not None:
                units = 2 * encoding.frames
                report("write_mp4", 0, units)
                encoding.wait(lambda done: report("write_mp4", done, units))
                writer.add_audio(audio)
                media = writer.close(progress=lambda done: report("write_mp4", units // 2 + done, units))
                report("write_mp4", units, units)
                lap("write_mp4")
        except BaseException:
            if writer is not None:
                encoding.stop()
                writer.abort()
            raise
        return video, audio, media

    @tracks_device_memory
    def __call__(
        self,
        prompt: str,
        *,
        image=None,
        last_image=None,
        references: list | None = None,
        aspect_ratio: str | None = None,
        seconds: float | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        forwards: int | None = None,
        video_shift: float | None = None,
        audio_shift: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
        callback: ProgressCallback | None = None,
        quality: str | None = None,
        decode: bool = True,
        plan: bool = False,
        plan_max_tokens: int | None = None,
        prompts: list[str] | None = None,
        window_frames: int | None = None,
        overlap_frames: int | None = None,
        output_path=None,
        audio_sample_rate: int | None = None,
        cache: dict | StepCacheConfig | None = None,
        loras: list | None = None,
    ) -> H3Output:
        """Generate a clip.

        Args:
            prompt: the description, used verbatim.
            image, last_image: fl2va keyframes (path, PIL image or uint8 array) the video starts / ends on.
            references: ref2va references, in the order the model reads them: `ImageReference`, `VideoReference`,
                `AudioReference` (paths or in-memory media), PIL images, or file paths (kind by suffix or content).
                At most 9 images, 3 videos, 3 audios, 12 in all; audio never alone. Needs a pipeline loaded with
                workflow "ref2va" or "all".
            aspect_ratio: "W:H" in 1:4 .. 4:1; default 16:9 for t2va and ref2va and the first keyframe's ratio for
                fl2va.
            seconds: 5 to 15 (rounded to a 17n+5 frame count at 24 fps); `num_frames` overrides it. Default 5, or
                for ref2va the length of the first reference with sound. Longer, up to `self.max_seconds` (60 by
                default, at most 300): the clip is made in overlapping windows (`continuation.py`) and streamed to
                `output_path`; the returned `H3Output` then holds `path` and `media`, not the frames.
            height, width: explicit canvas in pixels, multiples of 32 (both or neither).
            num_inference_steps: sigma grid points as in diffusers (N points = N - 1 transformer forwards), 2 to
                1000; default 50, or the recipe's when an adapter brings one.
            forwards: transformer forwards (SGLang's and vLLM-Omni's count), 1 to 999, instead of
                `num_inference_steps` (give one or neither).
            video_shift, audio_shift: this call's schedule shifts (default: the pipeline's, 12 and 3 for the
                released checkpoint, or the recipe's).
            seed / generator: noise source; a seed makes a fresh CPU generator. Neither: a random seed.
            latents `(1, 24, F_lat, H/16, W/16)`, audio_latents `(2, 32, A)`: initial noise instead of drawing it.
            callback: `callback(stage, step, total)` when each stage starts (`step` 0), before each unit of work
                inside it and after it; an exception it raises stops the call.
            quality: `exact`, `lossless` or `high` for this call (default: the pipeline's); `fast` and
                `fast+high` only on a pipeline loaded with fast or fast+high (`h3gen.options.QUALITY_HELP`). `high`
                adds the first-block step cache (`step_cache.py`); the forwards it skipped are `cached_steps`.
            cache: the step cache's knobs for `high` / `fast+high`: a dict with any of `threshold` (0 to 1, default
                0.04), `warmup` (0 to 1000, default 4), `max_consecutive` (1 to 1000, default 1).
            decode: False skips both VAE decodes (the stages are still reported) and returns `video` and `audio`
                as None: what the other ranks of a parallel run do, since rank 0 decodes.
            plan: first rewrite `prompt` with the pipeline's planner (subjects, motion, camera, sound effects,
                music, dialogue; the first keyframe goes along when the planner reads images); the clip is made
                from the planned prompt, returned as `planned_prompt`. Off by default. `plan_max_tokens` caps it.
            output_path: write the clip there as a verified MP4 (H.264 + AAC, `audio_sample_rate` 32000 or 48000,
                default 32000) as part of the call, the video encoded while the audio decodes; the output's `video`
                is then None (the frames are in the file) and `media` describes the file. Stage `write_mp4`. A clip
                over 15 s needs it: it is written there window by window and never held whole.
            prompts: a clip over 15 s: one prompt per window (or one for all) instead of `prompt`.
            window_frames, overlap_frames: a clip over 15 s: window and overlap lengths on the 17n+5 frame grid
                (default 277 and 22; window 124 to 345, overlap shorter than the window).
            loras: adapters for this call, stacked: `[name_or_path, (name_or_path, scale), ...]` (scale default
                1.0); names come from `load_lora`, a path not loaded yet is loaded under its stem. Applied unmerged;
                the next call with another set switches without reloading anything. ref2va applies them to
                `transformer_ref`. Returned as `loras` with the merged ones (`load_lora(merge=True)`) first. A
                few-step adapter (LightX2V Turbo, FlashGen; `recipes.py`) brings its recipe: without a step count
                the call runs the recipe's forwards and shifts, and one that contradicts it raises `RequestError`
                naming the recipe.
        Returns:
            `H3Output`.
        """
        report = callback or (lambda stage, step, total: None)
        fields = dict(
            image=image,
            last_image=last_image,
            references=references,
            aspect_ratio=aspect_ratio,
            seconds=seconds,
            num_frames=num_frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            forwards=forwards,
            video_shift=video_shift,
            audio_shift=audio_shift,
            seed=seed,
            generator=generator,
            latents=latents,
            audio_latents=audio_latents,
            prompts=prompts,
            window_frames=window_frames,
            overlap_frames=overlap_frames,
        )
        planned = self._planned_prompt(prompt, fields, plan_max_tokens, report) if plan else None
        if references is not None:
            self._transformer_for("ref2va")  # before decoding any media
        cache_config = self._cache_config(self.options.request_quality(quality), cache)
        request = self.validate(
            planned or prompt, step_cache=cache_config is not None, recipes=self._recipes(loras, references), **fields
        )
        model = self._transformer_for(request.task)
        adapters = self._request_loras(loras, request.task)
        tier = self._tier(quality)
        timings = {}
        started = time.perf_counter()

        def lap(stage: str):
            nonlocal started
            now = time.perf_counter()
            timings[stage] = now - started
            started = now

        if request.continuation is not None:
            if cache_config is not None:
                raise RequestError(
                    "quality high (the step cache) is not available for clips over 15 s: each window "
                    "is denoised on its own; use lossless or fast for them.",
                    "quality",
                )
            info, timings = run_continuation(
                self,
                request,
                report=report,
                tier=tier,
                decode=decode,
                output_path=output_path,
                audio_sample_rate=audio_sample_rate,
                adapters=adapters,
            )
            return H3Output(
                video=None,
                audio=None,
                fps=geometry.FPS,
                sample_rate=int(self.audio_vae.config.sampling_rate),
                seed=request.seed,
                timings=timings,
                planned_prompt=planned,
                path=None if info is None else str(output_path),
                media=info,
                windows=request.continuation.num_windows,
                sampling=request.sampling.describe(),
                loras=self._applied_loras(model, adapters),
            )
        text = self._encode_text(request, report)
        lap("encode_text")
        noise = self.draw_noise(request)
        video_rows, audio_rows, blocks = self._initial_rows(request, noise, report)
        lap("encode_conditions")
        video_latents, audio_latents, cached_steps, forwards = self._denoise(
            request, text, video_rows, audio_rows, report, tier, blocks, cache_config, adapters=adapters
        )
        lap("denoise")
        video, audio, media = self._decode(
            video_latents, audio_latents, decode, report, lap, tier, output_path, audio_sample_rate
        )
        return H3Output(
            video=video,
            audio=audio,
            fps=geometry.FPS,
            sample_rate=int(self.audio_vae.config.sampling_rate),
            seed=request.seed,
            timings=timings,
            planned_prompt=planned,
            path=str(output_path) if media is not None else None,
            media=media,
            cached_steps=cached_steps,
            num_forwards=forwards,
            sampling=request.sampling.describe(),
            loras=self._applied_loras(model, adapters),
        )
