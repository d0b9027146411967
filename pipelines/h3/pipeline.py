"""`H3Pipeline`: a `GenerationRequest` (prompt, and keyframes or references) -> video frames + stereo audio,
identical to diffusers' MiniMax-H3 blocks.

The flow, each stage handing one value to the next (`stages.py`, `decode_stages.py`):
  prepare (`request.py`) -> encode text -> draw noise -> encode conditions (keyframes, or references: pictures
  through the video VAE, sound through the audio VAE) -> pack -> denoise (one transformer forward per step, two
  schedules) -> decode video -> decode audio -> write the MP4.
A clip over 15 s runs the same stages per window (`long_video.py`).
t2va and fl2va run on `transformer/`, ref2va on its own partition `transformer_ref/` (same architecture).
`callback(stage, step, total)` reports progress from outside the stages; they know nothing about HTTP or bars. Each
stage reports when it starts (`step` 0), at points inside it (before each unit of work of its long calls: text
encoder layers, VAE blocks), and when it ends (`step == total`); an exception the callback raises stops the call
there, which is how a job is cancelled within a fraction of a second in any stage.
"""

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from h3gen.errors import CheckpointError, RequestError
from h3gen.kernels.attention import resolve_backend
from h3gen.options import RunOptions, base_tier, uses_step_cache
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.adapter_memory import tracks_device_memory
from h3gen.pipelines.h3.assembly import PartBuilders, assemble
from h3gen.pipelines.h3.checkpoint import REQUIRED, H3Checkpoint, resolve_workflow
from h3gen.pipelines.h3.continuation import DEFAULT_MAX_SECONDS
from h3gen.pipelines.h3.decode_stages import ClipWriter, decode_frames, decode_sound
from h3gen.pipelines.h3.fasth3 import CONTRACT_FILE, read_student_contract
from h3gen.pipelines.h3.fasth3_adapter import FastH3Adapter, split_load_time_loras
from h3gen.pipelines.h3.generation import GenerationRequest
from h3gen.pipelines.h3.loader import transformer_host_bytes
from h3gen.pipelines.h3.long_video import largest_window, run_continuation
from h3gen.pipelines.h3.lora_registry import DEFAULT_MAX_CPU_LORAS, activate
from h3gen.pipelines.h3.output import H3Output
from h3gen.pipelines.h3.pipeline_adapters import PipelineAdapters, partition_for
from h3gen.pipelines.h3.preview import PreviewMaker, preview_maker
from h3gen.pipelines.h3.references import AudioReference, ImageReference, VideoReference
from h3gen.pipelines.h3.request import (
    H3Request,
    check_activation_budget,
    prepare_request,
    read_transformer_config,
    with_prompt,
)
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT
from h3gen.pipelines.h3.stages import Components, denoise, draw_noise, encode_conditions, encode_text, pack
from h3gen.pipelines.h3.step_cache_config import StepCacheConfig
from h3gen.pipelines.h3.text_encoder import H3TextEncoder
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.vae import load_audio_vae, load_video_vae
from h3gen.pipelines.h3.video_decode import to_fp8_decoder

logger = logging.getLogger(__name__)

__all__ = ["AudioReference", "GenerationRequest", "H3Output", "H3Pipeline", "ImageReference", "VideoReference"]

ProgressCallback = Callable[[str, int, int], None]


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


def _file_builders(
    checkpoint: H3Checkpoint, options: RunOptions, torch_dtype: torch.dtype, parallel, adapter=None
) -> PartBuilders:
    """Every part loaded from the checkpoint's files; a FastH3 `adapter` merged into `transformer/` as it loads."""

    def transformer(name, placement, store):
        return H3Transformer.from_pretrained(
            checkpoint.folder(name),
            torch_dtype=torch_dtype,
            device=placement.transformer_device,
            parallel=parallel,
            quantization=options.quantization,
            skip_prefixes=placement.skip_prefixes(store),
            adapter=adapter if name == "transformer" else None,
        )

    def text_encoder(placement):
        return H3TextEncoder.from_pretrained(
            checkpoint.folder("text_encoder"),
            checkpoint.folder("tokenizer"),
            checkpoint.components.get("processor"),
            dtype=torch_dtype,
            device=placement.stage_device,
        )

    def vaes(placement):
        return (
            load_video_vae(checkpoint.folder("vae"), dtype=torch_dtype, device=placement.stage_device),
            load_audio_vae(checkpoint.folder("audio_vae"), device=placement.stage_device),
        )

    return PartBuilders(transformer, text_encoder, vaes)


class H3Pipeline:
    """MiniMax-H3 text(+keyframes or references)-to-video-and-audio. Build with `from_pretrained`; run with
    `run(GenerationRequest(...))` or `pipe(prompt, **fields)`.

    `transformer` serves t2va / fl2va and `transformer_ref` ref2va; either may be None when the pipeline was loaded
    for the other task only. How it runs is one `RunOptions` (`h3gen.options`).
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
        options: RunOptions | None = None,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        transformer_ref=None,
        planner=None,
        max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
        lora_gpu_memory=None,
        fasth3_adapter: FastH3Adapter | None = None,
    ):
        if transformer is None and transformer_ref is None:
            raise ValueError("H3Pipeline needs a transformer, a transformer_ref, or both.")
        self.options = options or RunOptions()
        self.transformer = transformer
        self.transformer_ref = transformer_ref
        self.text_encoder = text_encoder
        self.vae = vae
        self.audio_vae = audio_vae
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        self.video_shift = video_shift
        self.audio_shift = audio_shift
        # A FastH3 student's sampling contract (`fasth3.py`), or None for the base model: the checkpoint's, or that
        # of the FastH3 adapter merged into `transformer` at load (`fasth3_adapter.py`).
        self.fasth3_adapter = fasth3_adapter
        if fasth3_adapter is not None:
            self.student = fasth3_adapter.contract(video_shift, audio_shift)
        else:
            self.student = read_student_contract(
                checkpoint.root,
                gated=any(getattr(m, "gates", False) for m in (transformer, transformer_ref) if m is not None),
                video_shift=video_shift,
                audio_shift=audio_shift,
            )
        # Optional prompt planner (`h3gen.pipelines.k3.planner`): `plan(prompt, image=...) -> PlannedPrompt`.
        self.planner = planner
        # Longest clip a call may ask for (over 15 s it is made in windows); a server raises it up to 300 s.
        self.max_seconds = DEFAULT_MAX_SECONDS
        for model in self._transformers():
            set_quality(model, self.quality, attention=self.options.attention_for(self.quality))
        if base_tier(self.quality) == "fast" and vae is not None:
            to_fp8_decoder(vae)
        self.adapters = PipelineAdapters(
            {"transformer": transformer, "transformer_ref": transformer_ref},
            self.device,
            transformer_for=self.transformer_for,
            max_cpu_loras=max_cpu_loras,
            gpu_memory=lora_gpu_memory,
        )

    @property
    def quality(self) -> str:
        """The default tier (`RunOptions.quality`)."""
        return self.options.quality

    @property
    def workflow(self) -> str:
        return self.options.workflow

    @property
    def offload(self) -> str:
        return self.options.offload

    @property
    def components(self) -> Components:
        """What the stages around the transformer run on (`stages.Components`)."""
        return Components(self.text_encoder, self.vae, self.audio_vae, self.device, self.config, self.offload)

    @property
    def loras(self):
        """The registry of loaded adapter files (`lora_registry.LoraRegistry`)."""
        return self.adapters.registry

    @property
    def device_memory(self):
        """What the device has free for adapters (`adapter_memory.DeviceMemory`)."""
        return self.adapters.device_memory

    def _transformers(self) -> list:
        return [model for model in (self.transformer, self.transformer_ref) if model is not None]

    @property
    def config(self):
        """The transformer architecture (both partitions share it)."""
        return self._transformers()[0].config

    def transformer_for(self, task: str):
        """The partition that serves `task`, or a `RequestError` saying how to load it."""
        model = self.transformer_ref if task == "ref2va" else self.transformer
        if model is None:
            need = "workflow='ref2va' or 'all'" if task == "ref2va" else "workflow='t2va', 'fl2va' or 'all'"
            raise RequestError(
                f"this pipeline was loaded without its {partition_for(task)}/ partition, which {task} needs; load it "
                f"with {need}.",
                "references" if task == "ref2va" else "task",
            )
        return model

    @classmethod
    def from_pretrained(
        cls,
        path,
        device=None,
        torch_dtype: torch.dtype = torch.bfloat16,
        options: RunOptions | None = None,
        *,
        parallel=None,
        planner=None,
        max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
        lora_gpu_memory=None,
        loras: list | None = None,
        **option_fields,
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

        `loras` (`[path or (path, scale), ...]`) are merged into `transformer/` for good at load. A FastH3 adapter
        (`fastvideo-lora-v2`, at most one, scale 1) is merged into the weights as they stream in, before
        tensor-parallel slicing, MXFP4 quantization and offload staging, creating the VSA gates it sets; the pipeline
        then runs as the full student (its `student` contract: 4 forwards, VSA-H3 at 0.9 when gated, dense
        otherwise). Any other adapter is merged after loading as `load_lora(path, merge=True, scale=scale)` does
        (its few-step recipe then applies to every call). Errors name the file by its name only.
        """
        options = RunOptions.merged(options, **option_fields)
        device = _resolve_device(device)
        checkpoint = H3Checkpoint.open(path)
        options = replace(options, workflow=resolve_workflow(checkpoint, options.workflow, device))
        tasks = checkpoint.tasks() if options.workflow == "all" else (options.workflow,)
        for task in tasks or ("t2va",):  # an empty "all" reports what t2va misses
            checkpoint.require(task)
        partitions = tuple(
            name for name in ("transformer", "transformer_ref") if any(name in REQUIRED[task] for task in tasks)
        )
        if options.attention is not None:
            _check_attention(
                options.attention, device, torch_dtype, read_transformer_config(checkpoint).attention_head_dim
            )
        adapter, merged = split_load_time_loras(loras)
        if adapter is not None:
            if "transformer" not in partitions:
                raise RequestError(
                    f"FastH3 adapter {adapter.name} merges into transformer/, which workflow {options.workflow!r} "
                    "does not load; load with workflow 't2va'.",
                    "loras",
                )
            if (checkpoint.root / CONTRACT_FILE).exists():
                raise CheckpointError(
                    f"FastH3 adapter {adapter.name} is made for the base model, but this checkpoint is a FastH3 "
                    f"student already (it has {CONTRACT_FILE})."
                )
        loaded_bytes = {}
        if options.offload == "layerwise":  # the transformer's host copy, checked against host memory before loading
            for name in partitions:
                loaded_bytes[name] = transformer_host_bytes(
                    H3Transformer,
                    checkpoint.folder(name),
                    torch_dtype,
                    options.quantization,
                    adapter if name == "transformer" else None,
                )
        pipe = assemble(
            cls,
            checkpoint,
            options,
            device,
            _file_builders(checkpoint, options, torch_dtype, parallel, adapter),
            partitions=partitions,
            parallel=parallel,
            planner=planner,
            max_cpu_loras=max_cpu_loras,
            lora_gpu_memory=lora_gpu_memory,
            fasth3_adapter=adapter,
            loaded_bytes=loaded_bytes,
        )
        for path, scale in merged:
            pipe.load_lora(path, merge=True, scale=scale)
        return pipe

    # ------------------------------------------------------------------ checking a request

    def prepare(
        self,
        request: GenerationRequest,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
        adapters: list | None = None,
        recipes: list | None = None,
        lora_files: list | None = None,
        tier: str | None = None,
        max_seconds: float | None = None,
    ) -> H3Request:
        """Check `request` against this pipeline before any model work (`prepare_request`; shifts left unset are
        this pipeline's; its adapters' recipes apply) and against the GPU budgets (`check_budgets`). References are
        decoded here, once.

        `adapters` (`[(Adapter, scale)]`) are the request's `loras` when the caller resolved them already; a server
        that names its adapters in its own folder passes their `recipes` and `lora_files` (`LoraFile`s) instead.
        `tier`: the request's quality tier when resolved already."""
        if request.references is not None:
            self.transformer_for("ref2va")  # before decoding any media
        if recipes is None:
            adapters = self.adapters.resolve(request.loras) if adapters is None else adapters
            recipes = self.adapters.recipes(adapters, request.task)
            lora_files = [adapter.file for adapter, _ in adapters] if lora_files is None else lora_files
        prepared = prepare_request(
            self.checkpoint,
            self.config,
            request,
            recipes=recipes,
            default_shifts=(self.video_shift, self.audio_shift),
            generator=generator,
            latents=latents,
            audio_latents=audio_latents,
            max_seconds=self.max_seconds if max_seconds is None else max_seconds,
            student=self.student,
        )
        self.check_budgets(prepared, lora_files, tier)
        return prepared

    def check_budgets(self, prepared: H3Request, lora_files: list | None = None, tier: str | None = None) -> None:
        """The GPU budgets of a prepared request: its adapters' device copies (`lora_files`) and, under layer-wise
        offload, its activations (the step cache's too at quality high; a clip over 15 s: its largest window's)."""
        task = prepared.task
        if lora_files:
            self.adapters.check_budget(lora_files, task)
        budget = getattr(self.transformer_for(task), "activation_budget_bytes", None)
        if budget is not None:
            if tier is None:
                tier = self.options.request_quality(prepared.spec.quality if prepared.spec is not None else None)
            sized = prepared if prepared.continuation is None else largest_window(prepared)
            check_activation_budget(
                sized,
                len(self.text_encoder.tokenize(sized.prompt)),
                self.config,
                budget,
                step_cache=uses_step_cache(tier),
            )

    def validate(self, prompt, *, lora_files: list | None = None, max_seconds: float | None = None, **fields):
        """`prepare` from keywords: `GenerationRequest(prompt, **fields)`, with `generator`, `latents` and
        `audio_latents` passed through."""
        extra = {name: fields.pop(name) for name in ("generator", "latents", "audio_latents") if name in fields}
        return self.prepare(
            GenerationRequest(prompt, **fields), lora_files=lora_files, max_seconds=max_seconds, **extra
        )

    def initial_noise(self, *, seed: int, **fields) -> tuple[torch.Tensor, torch.Tensor]:
        """The `(latents (1, C, F, h, w), audio_latents (2, C, A))` a seed draws for a request (same fields as
        `GenerationRequest`, without the prompt). Passing them back reproduces that seed's output."""
        noise = draw_noise(self.components, self.validate("noise", seed=seed, **fields))
        audio = noise.audio_rows.reshape(2, -1, noise.audio_rows.shape[-1]).permute(0, 2, 1).contiguous()
        return noise.video, audio

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
        return self.adapters.load(path, name, alpha, merge=merge, scale=scale)

    # ------------------------------------------------------------------ running

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

    def plan_prompt(self, prepared: H3Request, report: ProgressCallback | None = None) -> H3Request:
        """The prepared request made from the planner's rewrite of its prompt (the first keyframe goes along when the
        planner reads images); stage `plan`."""
        if self.planner is None:
            raise RequestError(
                "plan=True needs a pipeline built with a planner (H3Pipeline(..., planner=...)).", "plan"
            )
        report = report or (lambda stage, step, total: None)
        spec = prepared.spec
        keyframe = spec.image if getattr(self.planner, "accepts_images", False) else None
        report("plan", 0, 1)
        planned = self.planner.plan(spec.prompt, image=keyframe, max_tokens=spec.plan_max_tokens, seed=spec.seed)
        report("plan", 1, 1)
        return with_prompt(prepared, planned.planned)

    @tracks_device_memory
    def run(
        self,
        request: GenerationRequest | H3Request,
        *,
        callback: ProgressCallback | None = None,
        decode: bool = True,
        output_path=None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
    ) -> H3Output:
        """Generate the clip `request` asks for (a `GenerationRequest`, or one already prepared by `prepare` or
        `prepare_request`, whose media are then not decoded again).

        callback: `callback(stage, step, total)` when each stage starts (`step` 0), before each unit of work inside
            it and after it; an exception it raises stops the call. A callback that takes a fourth argument also
            gets the previews, `callback("preview", forward, forwards, preview)` with a `preview.Preview` (the
            picture, uint8 `(H, W, 3)`), at the request's `preview_every` cadence (`preview.py`).
        decode: False skips both VAE decodes (the stages are still reported) and returns `video` and `audio` as
            None: what the other ranks of a parallel run do, since rank 0 decodes.
        output_path: write the clip there as a verified MP4 (H.264 + AAC at the request's `audio_sample_rate`) as
            part of the call, the video encoded while the audio decodes; the output's `video` is then None and
            `media` describes the file. Stage `write_mp4`. A clip over 15 s needs it: it is written there window by
            window and never held whole.
        generator / latents `(1, 24, F_lat, H/16, W/16)` / audio_latents `(2, 32, A)`: a caller's own noise source
            or initial noise instead of the seed's (a `GenerationRequest` only).
        Returns `H3Output`."""
        report = callback or (lambda stage, step, total: None)
        given = request if isinstance(request, GenerationRequest) else request.spec
        spec = given or GenerationRequest(request.prompt)
        tier = self._tier(spec.quality)
        cache = self._cache_config(tier, spec.cache)
        adapters = self.adapters.resolve(spec.loras)
        if isinstance(request, GenerationRequest):
            prepared = self.prepare(
                request, generator=generator, latents=latents, audio_latents=audio_latents, adapters=adapters, tier=tier
            )
        else:
            prepared = request
            self.check_budgets(prepared, [adapter.file for adapter, _ in adapters], tier)
        planned = None
        if spec.plan:
            prepared = self.plan_prompt(prepared, report)
            planned = prepared.spec.prompt
        transformer = self.transformer_for(prepared.task)
        activate(transformer, adapters, prepared.task, self.device)
        previews = preview_maker(self.components, callback, prepared.spec or spec, tier=tier, decode=decode)
        summary = dict(
            fps=geometry.FPS,
            sample_rate=int(self.audio_vae.config.sampling_rate),
            seed=prepared.seed,
            planned_prompt=planned,
            sampling=prepared.sampling.describe()
            | {"sparsity": list(prepared.sparsity) if prepared.sparsity is not None else None},
            loras=([(self.fasth3_adapter.name, 1.0)] if self.fasth3_adapter is not None else [])
            + self.adapters.applied(prepared.task, adapters),
        )
        if prepared.continuation is not None:
            if cache is not None:
                raise RequestError(
                    "quality high (the step cache) is not available for clips over 15 s: each window "
                    "is denoised on its own; use lossless or fast for them.",
                    "quality",
                )
            info, timings = run_continuation(
                self.components,
                transformer,
                prepared,
                report=report,
                tier=tier,
                decode=decode,
                output_path=output_path,
                audio_sample_rate=spec.audio_sample_rate,
                preview=previews,
            )
            path = None if info is None else str(output_path)
            return H3Output(
                None,
                None,
                timings=timings,
                path=path,
                media=info,
                windows=prepared.continuation.num_windows,
                num_forwards=prepared.sampling.forwards * prepared.continuation.num_windows,
                **self._preview_summary(previews),
                **summary,
            )
        return self._run_plain(prepared, transformer, report, tier, cache, decode, output_path, summary, previews)

    @staticmethod
    def _preview_summary(previews: PreviewMaker | None) -> dict:
        return {} if previews is None else {"previews": previews.count, "preview_seconds": previews.seconds}

    def _run_plain(
        self, prepared, transformer, report, tier, cache, decode, output_path, summary, previews=None
    ) -> H3Output:
        """A request of at most 15 s, stage by stage; see `run`."""
        parts, timings = self.components, {}
        started = time.perf_counter()

        def lap(stage: str):
            nonlocal started
            now = time.perf_counter()
            timings[stage] = now - started
            started = now

        text = encode_text(parts, prepared, report)
        lap("encode_text")
        rows = encode_conditions(parts, prepared, draw_noise(parts, prepared), report)
        lap("encode_conditions")
        layout = pack(prepared, text, rows.blocks, self.config.patch_size)
        made = denoise(
            transformer,
            prepared,
            text,
            rows,
            layout,
            report,
            device=self.device,
            tier=tier,
            cache=cache,
            preview=previews,
        )
        lap("denoise")
        video = audio = media = writer = None
        if not decode:
            for stage in ("decode_video", "decode_audio"):
                report(stage, 0, 1)
                report(stage, 1, 1)
                lap(stage)
        else:
            video = decode_frames(parts, made.video, report, tier=tier, on_device=output_path is not None)
            lap("decode_video")
            if output_path is not None:
                audio_rate = prepared.spec.audio_sample_rate if prepared.spec is not None else None
                writer = ClipWriter(output_path, video, sample_rate=parts.sample_rate, audio_sample_rate=audio_rate)
                video = None
            try:
                audio = decode_sound(parts, made.audio, report)
                lap("decode_audio")
                if writer is not None:
                    media = writer.finish(audio, report)
                    lap("write_mp4")
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
        return H3Output(
            video,
            audio,
            timings=timings,
            path=str(output_path) if media is not None else None,
            media=media,
            cached_steps=made.cached_steps,
            num_forwards=made.forwards,
            **self._preview_summary(previews),
            **summary,
        )

    def __call__(
        self,
        prompt: str,
        *,
        callback: ProgressCallback | None = None,
        decode: bool = True,
        output_path=None,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        audio_latents: torch.Tensor | None = None,
        **fields,
    ) -> H3Output:
        """Generate a clip: `run(GenerationRequest(prompt, **fields), ...)`. The fields (image, last_image,
        references, aspect_ratio, seconds, num_frames, height, width, num_inference_steps, forwards, video_shift,
        audio_shift, seed, quality, cache, loras, prompts, window_frames, overlap_frames, audio_sample_rate, plan,
        plan_max_tokens, preview_every) are described on `GenerationRequest`; the others on `run`."""
        return self.run(
            GenerationRequest(prompt, **fields),
            callback=callback,
            decode=decode,
            output_path=output_path,
            generator=generator,
            latents=latents,
            audio_latents=audio_latents,
        )
