"""The generation engine behind the job manager: validates requests against the checkpoint (cheap, no weights)
and runs them through one `H3Pipeline` loaded once."""

import logging
import threading
from pathlib import Path
from typing import Callable

import torch

from h3gen.errors import RequestError
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.references import AudioReference, ImageReference, VideoReference
from h3gen.pipelines.h3.request import prepare_request, read_transformer_config
from h3gen.server.schemas import REFERENCE_FIELDS, GenerationRequest

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


def pipeline_arguments(request: dict, uploads: dict[str, Path]) -> dict:
    """The `H3Pipeline.__call__` keywords of a normalized request and its files (every rank builds the same)."""
    references = references_of(uploads)
    return dict(image=uploads.get("image"), last_image=uploads.get("last_image"),
                references=references or None, height=request["height"], width=request["width"],
                num_frames=request["num_frames"], num_inference_steps=request["num_inference_steps"],
                seed=request["seed"], quality=request.get("quality"))


class H3Engine:
    """One model on one device. `validate` runs in request handlers; `load` and `run` on the engine worker."""

    def __init__(self, model_path, *, device: str | None = None, dtype: torch.dtype | None = None,
                 quality: str = "lossless", offload: dict | None = None, workflow: str = "auto", planner=None):
        self.model_path = Path(model_path)
        self.checkpoint = H3Checkpoint.open(self.model_path)
        self.config = read_transformer_config(self.checkpoint)
        # The tasks this server answers: every one the checkpoint holds, or those of one workflow (ref2va has its
        # own transformer partition, so serving it next to t2va / fl2va holds both in memory).
        available = self.checkpoint.tasks()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if workflow == "auto":
            workflow = self._auto_workflow(available)
        wanted = {"all": available, "t2va": ("t2va",), "fl2va": ("t2va", "fl2va"), "ref2va": ("ref2va",)}[workflow]
        self.tasks = tuple(task for task in wanted if task in available)
        self.workflow = workflow
        self.dtype = dtype or (torch.bfloat16 if self.device.startswith("cuda") else torch.float32)
        self.quality = quality
        self.offload = offload or {}  # offload, gpu_memory, prefetch, quantization for H3Pipeline.from_pretrained
        self.pipeline = None
        self.planner = planner  # h3gen.pipelines.k3.planner backend for `plan: true` jobs and /v1/prompts/plan
        self.load_error: str | None = None
        self._loaded = threading.Event()

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
            self.pipeline = H3Pipeline.from_pretrained(self.model_path, device=self.device, torch_dtype=self.dtype,
                                                       workflow=self.load_workflow(), quality=self.quality,
                                                       **self.offload)
        except Exception as error:  # reported on /health and by every job
            logger.exception("model failed to load")
            self.load_error = f"{type(error).__name__}: {error}"
        finally:
            self._loaded.set()

    # "auto" serves every task only while both partitions together take at most this share of the memory they would
    # load into: the tiny demo serves ref2va out of the box, the released model (2 x 62 GB) loads one partition.
    AUTO_ALL_SHARE = 0.25

    def _auto_workflow(self, available: tuple[str, ...]) -> str:
        """"all" when both partitions are small next to the device's memory (host memory on the CPU), else
        "fl2va" (t2va + fl2va on `transformer/`), logged, since ref2va would hold a second 62 GB partition."""
        if "ref2va" not in available or len(available) == 1:
            return "all"
        from h3gen.offload.host_memory import available_host_bytes, folder_bytes

        partitions = sum(folder_bytes(self.checkpoint.folder(name)) for name in ("transformer", "transformer_ref"))
        if self.device.startswith("cuda") and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(torch.device(self.device)).total_memory
        else:
            memory = available_host_bytes() or 0
        if partitions <= self.AUTO_ALL_SHARE * memory:
            return "all"
        logger.info("serving t2va and fl2va only: ref2va needs the transformer_ref/ partition as well (%.0f GB for "
                    "both); start with --workflow all (or ref2va) to serve it.", partitions / 1e9)
        return "fl2va"

    def load_workflow(self) -> str:
        """The `from_pretrained` workflow that loads what `self.tasks` need."""
        if "ref2va" in self.tasks:
            return "all" if len(self.tasks) > 1 else "ref2va"
        return "fl2va" if "fl2va" in self.tasks else "t2va"

    def validate(self, request: GenerationRequest, images: dict[str, Path]) -> dict:
        """Check a request fully (task, keyframes or references, geometry, seed) and return it normalized, with the
        resolved canvas, frame count and seed. `images` holds the uploads: `image` / `last_image`, and references
        keyed by `upload_name`. Raises `RequestError` naming the field."""
        quality = request.quality or self.quality
        if (quality == "fast") != (self.quality == "fast"):
            raise RequestError(f"this server runs the {self.quality} tier; quality {quality} is not available "
                               "(fast needs a server started with --quality fast, and such a server is fast only).",
                               "quality")
        if request.plan and self.planner is None:
            raise RequestError("this server has no prompt planner; start it with --planner tiny|<K3 folder>|<OpenAI-"
                               "compatible base URL>, or send plan: false.", "plan")
        references = references_of(images)
        keyframes = {name: path for name, path in images.items() if name in ("image", "last_image")}
        if request.task not in self.tasks:
            raise RequestError(f"this server does not serve task {request.task} (it serves "
                               f"{', '.join(self.tasks) or 'nothing'}; ref2va needs a model with transformer_ref/ and a "
                               "server started with --workflow all or ref2va).",
                               "task")
        if request.task != "fl2va" and keyframes:
            raise RequestError(f"task {request.task} takes no keyframes; use task fl2va for them.",
                               next(iter(keyframes)))
        if request.task != "ref2va" and references:
            raise RequestError(f"task {request.task} takes no references; use task ref2va for them.",
                               references[0].name)
        if request.task == "fl2va" and not keyframes:
            raise RequestError("task fl2va needs an image and/or a last_image upload.", "image")
        if request.task == "ref2va" and not references:
            raise RequestError("task ref2va needs at least one reference upload: ref_image, ref_video or ref_audio "
                               "(multipart, repeatable, in order).", "references")
        prepared = prepare_request(
            self.checkpoint, self.config, request.prompt, image=keyframes.get("image"),
            last_image=keyframes.get("last_image"), references=references or None,
            aspect_ratio=request.aspect_ratio, seconds=request.seconds,
            num_inference_steps=request.num_inference_steps, seed=request.seed,
        )
        shape = prepared.shape
        return request.model_dump() | {
            "seed": prepared.seed, "height": shape.height, "width": shape.width, "num_frames": shape.num_frames,
            "duration": round(shape.seconds, 4), "fps": 24, "quality": quality,
        } | ({"references": [reference.kind for reference in references]} if references else {})

    def plan(self, request: dict, images: dict[str, Path]) -> str:
        """The planned prompt of a normalized `plan: true` request (its first keyframe goes along when the planner
        reads images)."""
        if self.planner is None:
            raise RequestError("this server has no prompt planner.", "plan")
        image = images.get("image") if getattr(self.planner, "accepts_images", False) else None
        return self.planner.plan(request["prompt"], image=image, seed=request.get("seed")).planned

    def run(self, request: dict, images: dict[str, Path], out_path: Path,
            callback: Callable[[str, int, int], None]) -> None:
        """Generate one normalized request into `out_path` (MP4, verified), reporting through `callback`."""
        if self.pipeline is None:
            raise RuntimeError(f"the model is not loaded ({self.load_error or 'still loading'}).")
        output = self.pipeline(request["prompt"], callback=callback, **pipeline_arguments(request, images))
        callback("write_mp4", 0, 1)
        output.save(out_path, audio_sample_rate=request["audio_sample_rate"])
        callback("write_mp4", 1, 1)
