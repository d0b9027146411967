"""The generation engine behind the job manager: validates requests against the checkpoint (cheap, no weights)
and runs them through one `H3Pipeline` loaded once."""

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from h3gen.errors import CheckpointError, RequestError
from h3gen.options import RunOptions, uses_step_cache
from h3gen.pipelines.h3 import (
    DEFAULT_MAX_SECONDS,
    SPATIAL_COMPRESSION,
    AudioReference,
    GenerationRequest,
    ImageReference,
    VideoReference,
    check_device_budget,
    check_max_seconds,
    load_time_contract,
    lora_budget_bytes,
    lora_device_bytes,
    prepare_request,
    read_transformer_config,
    resolve_canvas,
)
from h3gen.pipelines.h3.checkpoint import H3Checkpoint, resolve_workflow
from h3gen.server.lora_folder import LoraChoice, LoraFolder
from h3gen.server.schemas import REFERENCE_FIELDS, GenerationBody

logger = logging.getLogger(__name__)

_REFERENCE_TYPES = {"ref_image": ImageReference, "ref_video": VideoReference, "ref_audio": AudioReference}


def upload_name(field: str, position: int) -> str:
    """How a reference upload is keyed among a job's files: its form field and its place in the reference order."""
    return f"{field}_{position}"


def references_of(uploads: dict[str, Path]) -> list:
    """The ref2va references among a job's uploads, in request order, each named after its form field."""
    found = []
    for key, path in uploads.items():
        field, _, position = key.rpartition("_")
        if field in REFERENCE_FIELDS and position.isdigit():
            found.append((int(position), _REFERENCE_TYPES[field](path, name=field)))
    return [reference for _, reference in sorted(found, key=lambda item: item[0])]


def generation_request(request: dict, uploads: dict[str, Path], lora_folder: LoraFolder | None = None):
    """The pipeline's `GenerationRequest` of a job: its normalized request (what the job store keeps) and its files
    (every rank builds the same). The job is pinned to what was resolved when it was submitted: canvas, frame count,
    step count (sigma points; a recipe's included) and seed. Its adapters are named in `lora_folder` (the server's
    --lora-dir)."""
    references = references_of(uploads)
    loras = None
    if request.get("loras"):
        if lora_folder is None:
            raise RequestError("this server serves no LoRA adapters (start it with --lora-dir DIR).", "loras")
        loras = [(str(choice.path), choice.scale) for choice in lora_folder.resolve(request["loras"])]
    return GenerationRequest(
        request["prompt"],
        image=uploads.get("image"),
        last_image=uploads.get("last_image"),
        references=references or None,
        height=request["height"],
        width=request["width"],
        num_frames=request["num_frames"],
        num_inference_steps=request["num_inference_steps"],
        video_shift=request.get("video_shift"),
        audio_shift=request.get("audio_shift"),
        seed=request["seed"],
        quality=request.get("quality"),
        cache=request.get("cache"),
        prompts=request.get("prompts"),
        window_frames=request.get("window_frames"),
        overlap_frames=request.get("overlap_frames"),
        audio_sample_rate=request.get("audio_sample_rate"),
        loras=loras,
        sparsity=request.get("sparsity"),
        dense_forwards=request.get("dense_forwards"),
        preview_every=request.get("preview_every"),
    )


class H3Engine:
    """One model on one device. `validate` runs in request handlers; `load` and `run` on the engine worker."""

    def __init__(
        self,
        model_path,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        quality: str | None = None,
        offload: dict | None = None,
        workflow: str | None = None,
        planner=None,
        options: RunOptions | None = None,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        lora_dir=None,
        lora_gpu_memory=None,
        merge_loras=None,
    ):
        """How the model loads and runs is one `RunOptions`: `options`, or its fields as `quality`, `workflow`
        (default "auto") and the `offload` dict (`offload`, `gpu_memory`, `prefetch`, `quantization`); keywords
        given next to `options` replace its fields. `max_seconds` (15 to 300): the longest clip a job may ask
        for; over 15 s it is made in windows. `lora_dir` is the folder of the adapters requests may name (None: no
        adapters); `lora_gpu_memory` ("4GiB") caps the device memory a request's adapters may take (None: the free
        device memory less 2 GiB on a GPU, no cap on the CPU), checked when a request is submitted. `merge_loras`
        (paths) are merged into the model at load (`H3Pipeline.from_pretrained(loras=...)`: a FastH3 adapter makes
        it the student)."""
        if options is None and workflow is None:
            workflow = "auto"
        options = RunOptions.merged(options, quality=quality, workflow=workflow, **(offload or {}))
        self.model_path = Path(model_path)
        self.max_seconds = check_max_seconds(max_seconds)
        self.checkpoint = H3Checkpoint.open(self.model_path)
        self.config = read_transformer_config(self.checkpoint)
        self.merge_loras = list(merge_loras or [])
        # The contract the loaded model will sample with (a FastH3 student's, from the checkpoint or a merged adapter)
        # and the merged adapters' recipes, so that requests queued while it loads are checked as it will run them.
        try:
            self.student, self.merged_recipes = load_time_contract(
                self.checkpoint, self.merge_loras, self.config.attention_head_dim
            )
        except (CheckpointError, RequestError):
            raise
        except Exception:  # weight files that cannot be read: the load fails on them, saying so
            self.student, self.merged_recipes = None, []
        # The tasks this server answers: every one the checkpoint holds, or those of one workflow (ref2va has its
        # own transformer partition, so serving it next to t2va / fl2va holds both in memory).
        available = self.checkpoint.tasks()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        workflow = resolve_workflow(self.checkpoint, options.workflow, self.device)
        wanted = {"all": available, "t2va": ("t2va",), "fl2va": ("t2va", "fl2va"), "ref2va": ("ref2va",)}[workflow]
        self.tasks = tuple(task for task in wanted if task in available)
        self.workflow = workflow
        self.options = replace(options, workflow=self.load_workflow())
        self.dtype = dtype or (torch.bfloat16 if self.device.startswith("cuda") else torch.float32)
        self.quality = options.quality
        self.pipeline = None
        self.planner = planner  # h3gen.pipelines.k3.planner backend for `plan: true` jobs and /v1/prompts/plan
        self.load_error: str | None = None
        self.lora_folder = None if lora_dir is None else LoraFolder(lora_dir, head_dim=self.config.attention_head_dim)
        self.lora_gpu_memory = lora_budget_bytes(lora_gpu_memory)

    @property
    def offload(self) -> dict:
        """The offload fields of `options`, as the `offload` keyword takes them."""
        return {name: getattr(self.options, name) for name in ("offload", "gpu_memory", "prefetch", "quantization")}

    @property
    def ready(self) -> bool:
        return self.pipeline is not None

    def devices(self) -> list[str]:
        if self.device.startswith("cuda") and torch.cuda.is_available():
            return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        return ["cpu"]

    def load(self) -> None:
        """Load every component (minutes for the released model). Failures are kept, not raised."""
        from h3gen.pipelines.h3.pipeline import H3Pipeline

        try:
            self.pipeline = H3Pipeline.from_pretrained(
                self.model_path,
                device=self.device,
                torch_dtype=self.dtype,
                options=self.options,
                lora_gpu_memory=self.lora_gpu_memory,
                loras=self.merge_loras,
            )
            self.pipeline.max_seconds = self.max_seconds
        except Exception as error:  # reported on /health and by every job
            logger.exception("model failed to load")
            self.load_error = f"{type(error).__name__}: {error}"

    def load_workflow(self) -> str:
        """The `from_pretrained` workflow that loads what `self.tasks` need."""
        if "ref2va" in self.tasks:
            return "all" if len(self.tasks) > 1 else "ref2va"
        return "fl2va" if "fl2va" in self.tasks else "t2va"

    def canvas(self, aspect_width: float, aspect_height: float) -> tuple[int, int]:
        """(height, width) of this model's canvas for an aspect ratio within 1:4 .. 4:1."""
        return resolve_canvas(
            aspect_width,
            aspect_height,
            multiple=SPATIAL_COMPRESSION * self.config.patch_size[2],
            short_edge=self.checkpoint.canvas_short_edge,
            max_pixels=self.checkpoint.canvas_max_pixels,
        )

    def validate(self, request: GenerationBody, images: dict[str, Path]) -> dict:
        """Check a request fully (task, keyframes or references, geometry, seed) and return it normalized, with the
        resolved canvas, frame count and seed. `images` holds the uploads: `image` / `last_image`, and references
        keyed by `upload_name`. Raises `RequestError` naming the field."""
        quality = self.options.request_quality(request.quality)
        if request.cache is not None and not uses_step_cache(quality):
            raise RequestError(f"cache applies to quality high or fast+high (this request runs {quality}).", "cache")
        if request.plan and self.planner is None:
            raise RequestError(
                "this server has no prompt planner; start it with --planner tiny|<K3 folder>|<OpenAI-"
                "compatible base URL>, or send plan: false.",
                "plan",
            )
        references = references_of(images)
        keyframes = {name: path for name, path in images.items() if name in ("image", "last_image")}
        if request.task not in self.tasks:
            raise RequestError(
                f"this server does not serve task {request.task} (it serves "
                f"{', '.join(self.tasks) or 'nothing'}; ref2va needs a model with transformer_ref/ and a "
                "server started with --workflow all or ref2va).",
                "task",
            )
        if request.task != "fl2va" and keyframes:
            raise RequestError(
                f"task {request.task} takes no keyframes; use task fl2va for them.", next(iter(keyframes))
            )
        if request.task != "ref2va" and references:
            raise RequestError(
                f"task {request.task} takes no references; use task ref2va for them.", references[0].name
            )
        if request.task == "fl2va" and not keyframes:
            raise RequestError("task fl2va needs an image and/or a last_image upload.", "image")
        if request.task == "ref2va" and not references:
            raise RequestError(
                "task ref2va needs at least one reference upload: ref_image, ref_video or ref_audio "
                "(multipart, repeatable, in order).",
                "references",
            )
        choices = self._lora_choices(request.loras)
        spec = GenerationRequest(
            request.prompt,
            image=keyframes.get("image"),
            last_image=keyframes.get("last_image"),
            references=references or None,
            aspect_ratio=request.aspect_ratio,
            seconds=request.seconds,
            num_inference_steps=request.num_inference_steps,
            forwards=request.forwards,
            video_shift=request.video_shift,
            audio_shift=request.audio_shift,
            seed=request.seed,
            quality=quality,
            prompts=request.prompts,
            window_frames=request.window_frames,
            overlap_frames=request.overlap_frames,
            sparsity=request.sparsity,
            dense_forwards=request.dense_forwards,
            preview_every=request.preview_every,
        )
        recipes = self.lora_folder.recipes(choices) if choices else []
        lora_files = [self.lora_folder.lora_file(choice) for choice in choices]
        if self.pipeline is not None:  # loaded: its GPU budgets (activations, adapters) are known too
            prepared = self.pipeline.prepare(spec, recipes=recipes, lora_files=lora_files, max_seconds=self.max_seconds)
        else:
            limit = self.max_seconds
            prepared = prepare_request(
                self.checkpoint,
                self.config,
                spec,
                recipes=self.merged_recipes + recipes,
                max_seconds=limit,
                student=self.student,
            )
            if lora_files and self.lora_gpu_memory is not None:  # a set cap applies while the model loads too
                need = sum(lora_device_bytes(lora, prepared.task, self.dtype.itemsize) for lora in lora_files)
                check_device_budget(need, [lora.name for lora in lora_files], self.lora_gpu_memory, None)
        shape = prepared.shape
        windows = {"windows": prepared.continuation.num_windows} if prepared.continuation else {}
        return (
            request.model_dump()
            | {
                "seed": prepared.seed,
                "seconds": prepared.seconds,  # the length asked for, or the default that applied
                "height": shape.height,
                "width": shape.width,
                "num_frames": shape.num_frames,
                "duration": round(shape.seconds, 4),
                "fps": 24,
                "quality": quality,
                "loras": [{"name": choice.name, "scale": choice.scale} for choice in choices],
            }
            | prepared.sampling.describe()
            | {"sparsity_per_forward": list(prepared.sparsity) if prepared.sparsity is not None else None}
            | windows
            | ({"references": [reference.kind for reference in references]} if references else {})
        )

    def _lora_choices(self, loras) -> list[LoraChoice]:
        """A request's adapters resolved in the LoRA folder (4xx naming the first bad name)."""
        if not loras:
            return []
        if self.lora_folder is None:
            raise RequestError("this server serves no LoRA adapters; start it with --lora-dir DIR.", "loras")
        return self.lora_folder.resolve(loras)

    def plan(self, request: dict, images: dict[str, Path]) -> str:
        """The planned prompt of a normalized `plan: true` request (its first keyframe goes along when the planner
        reads images)."""
        if self.planner is None:
            raise RequestError("this server has no prompt planner.", "plan")
        image = images.get("image") if getattr(self.planner, "accepts_images", False) else None
        return self.planner.plan(request["prompt"], image=image, seed=request.get("seed")).planned

    def run(
        self, request: dict, images: dict[str, Path], out_path: Path, callback: Callable[[str, int, int], None]
    ) -> dict:
        """Generate one normalized request into `out_path` (MP4, verified), reporting through `callback` (each stage
        when it starts, inside it and when it ends; an exception the callback raises stops the job there). Returns
        what the job's status reports of the run: `cached_steps` for quality high / fast+high, else nothing."""
        if self.pipeline is None:
            raise RuntimeError(f"the model is not loaded ({self.load_error or 'still loading'}).")
        spec = generation_request(request, images, self.lora_folder)
        output = self.pipeline.run(spec, callback=callback, output_path=out_path)
        return {"cached_steps": output.cached_steps} if uses_step_cache(request.get("quality")) else {}
