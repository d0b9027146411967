"""The generation engine behind the job manager: validates requests against the checkpoint (cheap, no weights)
and runs them through one `H3Pipeline` loaded once."""

import logging
import threading
from pathlib import Path
from typing import Callable

import torch

from h3gen.errors import RequestError
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.request import prepare_request, read_transformer_config
from h3gen.server.schemas import GenerationRequest

logger = logging.getLogger(__name__)


class H3Engine:
    """One model on one device. `validate` runs in request handlers; `load` and `run` on the engine worker."""

    def __init__(self, model_path, *, device: str | None = None, dtype: torch.dtype | None = None,
                 quality: str = "lossless", offload: dict | None = None):
        self.model_path = Path(model_path)
        self.checkpoint = H3Checkpoint.open(self.model_path)
        self.config = read_transformer_config(self.checkpoint)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = dtype or (torch.bfloat16 if self.device.startswith("cuda") else torch.float32)
        self.quality = quality
        self.offload = offload or {}  # offload, gpu_memory, prefetch, quantization for H3Pipeline.from_pretrained
        self.pipeline = None
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

        workflow = "fl2va" if "processor" in self.checkpoint.components else "t2va"
        try:
            self.pipeline = H3Pipeline.from_pretrained(self.model_path, device=self.device, torch_dtype=self.dtype,
                                                       workflow=workflow, quality=self.quality, **self.offload)
        except Exception as error:  # reported on /health and by every job
            logger.exception("model failed to load")
            self.load_error = f"{type(error).__name__}: {error}"
        finally:
            self._loaded.set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    def validate(self, request: GenerationRequest, images: dict[str, Path]) -> dict:
        """Check a request fully (task, keyframes, geometry, seed) and return it normalized, with the resolved
        canvas, frame count and seed. Raises `RequestError` naming the field."""
        quality = request.quality or self.quality
        if (quality == "fast") != (self.quality == "fast"):
            raise RequestError(f"this server runs the {self.quality} tier; quality {quality} is not available "
                               "(fast needs a server started with --quality fast, and such a server is fast only).",
                               "quality")
        if request.task == "ref2va":
            raise RequestError("task ref2va is not available in this version; use t2va or fl2va.", "task")
        if request.task == "t2va" and images:
            raise RequestError("task t2va takes no images; use task fl2va for keyframes.", next(iter(images)))
        if request.task == "fl2va":
            if not images:
                raise RequestError("task fl2va needs an image and/or a last_image upload.", "image")
            if "processor" not in self.checkpoint.components:
                raise RequestError("this model has no processor/ folder, so it cannot serve fl2va.", "task")
        prepared = prepare_request(
            self.checkpoint, self.config, request.prompt, image=images.get("image"),
            last_image=images.get("last_image"), aspect_ratio=request.aspect_ratio, seconds=request.seconds,
            num_inference_steps=request.num_inference_steps, seed=request.seed,
        )
        shape = prepared.shape
        return request.model_dump() | {
            "seed": prepared.seed, "height": shape.height, "width": shape.width, "num_frames": shape.num_frames,
            "duration": round(shape.seconds, 4), "fps": 24, "quality": quality,
        }

    def run(self, request: dict, images: dict[str, Path], out_path: Path,
            callback: Callable[[str, int, int], None]) -> None:
        """Generate one normalized request into `out_path` (MP4, verified), reporting through `callback`."""
        if self.pipeline is None:
            raise RuntimeError(f"the model is not loaded ({self.load_error or 'still loading'}).")
        output = self.pipeline(
            request["prompt"], image=images.get("image"), last_image=images.get("last_image"),
            height=request["height"], width=request["width"], num_frames=request["num_frames"],
            num_inference_steps=request["num_inference_steps"], seed=request["seed"], callback=callback,
            quality=request.get("quality"),
        )
        callback("write_mp4", 0, 1)
        output.save(out_path, audio_sample_rate=request["audio_sample_rate"])
        callback("write_mp4", 1, 1)
