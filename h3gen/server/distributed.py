"""Serving from several processes (`h3gen serve --tp T --ulysses U` under torchrun).

Rank 0 owns HTTP, the UI and the job manager; its engine broadcasts each job (the normalized request and the
uploaded files' bytes) to the other ranks over a control group, and every rank runs the same denoising steps. At
every progress point all ranks agree on one status with a tiny all-reduce, so a cancellation or a failure on any
rank stops every rank at the same step (no rank is left waiting in a collective), the job fails with the failing
rank's message, and the next job runs normally.

Only rank 0 decodes and writes the MP4; the other ranks skip the VAE decodes (`decode=False`). The decode and write
stages report many progress points on rank 0 and none in between on the others, so they are rank 0's alone: no
agreement there (a cancellation or failure in them stops rank 0, whose peers are already waiting for the next job).

Limits: a failure raised inside a collective (e.g. a rank dying mid-layer) is caught by the collective timeout,
not by the agreement.
"""

import datetime
import logging
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from h3gen.pipelines.h3 import DEFAULT_MAX_SECONDS, STAGES
from h3gen.server.engine import H3Engine, generation_request
from h3gen.server.job import DENOISE
from h3gen.server.job_worker import JobCancelled, JobLost, WorkerStopping

logger = logging.getLogger(__name__)

OK, CANCEL, FAIL = 0, 1, 2
# The stages after denoising (the decodes and the MP4 write) run on rank 0 only: never agreed on.
RANK0_STAGES = STAGES[STAGES.index(DENOISE) + 1 :]
# Waiting for the next job can take forever; the control group must not time out while idle.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class RankFailure(RuntimeError):
    """Another rank failed during this step; the message names it."""


class StepAgreement:
    """Called at every progress point on every rank: runs the local check, then agrees with the other ranks."""

    def __init__(self, group):
        self.group = group
        self.device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"

    def __call__(self, local_check, prompt: str, stage: str, step: int) -> None:
        status, message = OK, ""
        try:
            local_check()
        except (JobCancelled, WorkerStopping, JobLost):  # a stop everywhere; rank 0's worker knows which it was
            status = CANCEL
        except Exception as error:  # reported to every rank below
            status, message = FAIL, f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
        flag = torch.tensor([status], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()) == OK:
            return
        if int(flag.item()) == CANCEL:
            raise JobCancelled()
        messages = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(messages, message, group=self.group)
        raise RankFailure(next(m for m in messages if m))


class DistributedEngine(H3Engine):
    """Rank 0's engine: loads its shard of the model, and runs each job on every rank in lockstep."""

    def __init__(self, model_path, *, parallel, **kwargs):
        super().__init__(model_path, **kwargs)
        self.parallel = parallel
        self.control = dist.new_group(list(range(dist.get_world_size())), timeout=CONTROL_TIMEOUT)
        self.agree = StepAgreement(None)

    def devices(self) -> list[str]:
        return [f"{dist.get_world_size()} ranks (tp {self.parallel.tp} x ulysses {self.parallel.sp}) on {self.device}"]

    def load(self) -> None:
        _load(self)

    def run(self, request: dict, images: dict[str, Path], out_path: Path, callback) -> dict:
        payload = {
            "request": request,
            "images": {name: (path.suffix, path.read_bytes()) for name, path in images.items()},
        }
        dist.broadcast_object_list([("job", payload)], src=0, group=self.control)

        def agreed(stage: str, step: int, total: int, preview=None) -> None:
            if preview is not None:  # rank 0's alone, and it never stops the job: nothing to agree on
                callback(stage, step, total, preview)
            elif stage in RANK0_STAGES:
                callback(stage, step, total)
            else:
                self.agree(lambda: callback(stage, step, total), request["prompt"], stage, step)

        return super().run(request, images, out_path, agreed)

    def shutdown(self) -> None:
        dist.broadcast_object_list([("stop", None)], src=0, group=self.control)


def _load(engine) -> None:
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    try:
        engine.pipeline = H3Pipeline.from_pretrained(
            engine.model_path,
            device=engine.device,
            torch_dtype=engine.dtype,
            parallel=engine.parallel,
            options=engine.options,
            lora_gpu_memory=engine.lora_gpu_memory,
            loras=engine.merge_loras,
        )
        engine.pipeline.max_seconds = engine.max_seconds
    except Exception as error:
        logger.exception("model failed to load")
        engine.load_error = f"{type(error).__name__}: {error}"


def follow(
    model_path,
    *,
    parallel,
    device,
    dtype,
    quality=None,
    offload=None,
    workflow=None,
    options=None,
    max_seconds: float = DEFAULT_MAX_SECONDS,
    lora_dir=None,
    lora_gpu_memory=None,
    merge_loras=None,
) -> None:
    """The loop of every rank but 0: load the same model (the same run options, length limit, LoRA folder and budget as
    rank 0's engine: `options` or the `H3Engine` keywords), then run each broadcast job until told to stop."""
    engine = H3Engine(
        model_path,
        device=device,
        dtype=dtype,
        quality=quality,
        offload=offload,
        workflow=workflow,
        options=options,
        max_seconds=max_seconds,
        lora_dir=lora_dir,
        lora_gpu_memory=lora_gpu_memory,
        merge_loras=merge_loras,
    )
    engine.parallel = parallel
    control = dist.new_group(list(range(dist.get_world_size())), timeout=CONTROL_TIMEOUT)
    agree = StepAgreement(None)
    _load(engine)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        kind, payload = message[0]
        if kind == "stop":
            return
        request = payload["request"]
        with tempfile.TemporaryDirectory() as folder:
            images = {}
            for name, (suffix, data) in payload["images"].items():
                images[name] = Path(folder) / f"{name}{suffix}"
                images[name].write_bytes(data)

            def agreed(stage: str, step: int, total: int, request: dict = request) -> None:
                if stage not in RANK0_STAGES:
                    agree(lambda: None, request["prompt"], stage, step)

            try:
                engine.pipeline.run(
                    generation_request(request, images, engine.lora_folder), callback=agreed, decode=False
                )
            except (JobCancelled, RankFailure):
                continue
            except Exception:  # this rank's own failure outside an agreement point: logged; rank 0 times out
                logger.exception("rank %d failed a job", dist.get_rank())
