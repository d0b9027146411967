"""What a job is: its status, its stored record, and how far along it is.

A `Job` is one row of the job store (`store.py`); the manager (`jobs.py`) creates, runs and shows them. Statuses are
a `str` enum, so the database, the JSON views and the metrics all hold the plain strings (`"queued"`, ...).
"""

import enum
from dataclasses import dataclass, field, fields

from h3gen.pipelines.h3 import STAGES


class JobStatus(enum.StrEnum):
    """Where a job is in its life: queued -> running -> one of the finished three (or queued -> cancelled)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass
class Job:
    """One job as the store holds it. `request` is the normalized request in its serialized (JSON) form, with what
    the run added (`planned_prompt`, `cached_steps`); `uploads` maps a request field to the file kept for it;
    `timings` holds each stage's seconds; the times are Unix seconds. The last fields are the fleet's: a worker
    claims a queued job whose `needs` it can serve and holds it under a lease it renews (`store.JobStore.claim`)."""

    id: str
    status: JobStatus
    created_at: float
    request: dict
    uploads: dict[str, str] = field(default_factory=dict)
    progress: float = 0.0
    stage: str | None = None  # the stage running now; None once finished
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    result_path: str | None = None  # the MP4 of a succeeded job
    result_bytes: int | None = None
    attempts: int = 0  # how many times a worker has claimed it
    worker_id: str | None = None  # the worker holding it while it runs (afterwards, the one that ran it last)
    lease_expires: float | None = None  # while a worker holds it: when the lease runs out unless renewed
    cancel_requested: bool = False  # running: asked to stop; the holding worker is told at its next heartbeat
    needs: dict = field(default_factory=dict)  # what a worker must offer to run it (task, quality, seconds, loras)
    current_window: list | None = None  # a clip over 15 s while it runs: [index, count] of the window being made
    # While it runs: the latest preview (`JobFiles.preview`): made_at (Unix seconds), forward, forwards, window.
    preview: dict | None = None
    eta_seconds: float | None = None  # while it runs: the time left, from its measured step times (None: unknown)

    def __post_init__(self):
        self.status = JobStatus(self.status)
        self.cancel_requested = bool(self.cancel_requested)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


FIELDS = tuple(item.name for item in fields(Job))

# The stages a job's progress and status name: the planner first (when a request asks for a planned prompt), then
# the clip's own (`progress.STAGES`). A clip over 15 s reports WINDOW before each window; it is no stage of its own.
PLAN = "plan"
WINDOW = "window"
STAGE_ORDER = (PLAN, *STAGES)
DENOISE = "denoise"  # the stage of the denoising steps (the step-time metric times them)
PREVIEW = "preview"  # not a stage: a preview made while denoising (`pipelines/h3/preview.py`)
# Share of the progress bar each stage owns (sums to 100), of STAGES in their order; the planner owns none.
STAGE_WEIGHTS = {PLAN: 0, **dict(zip(STAGES, (4, 3, 84, 4, 3, 2), strict=True))}


def progress_of(stage: str, step: int, total: int, window: tuple[int, int] | None = None) -> float:
    """0-100 progress after `step` of `total` in `stage`, capped at 99 until the job is done. A clip made in
    windows (`window` = (index, count)) gives each window an equal share, its stages inside it."""
    index = STAGE_ORDER.index(stage) if stage in STAGE_ORDER else 0
    done = sum(STAGE_WEIGHTS[s] for s in STAGE_ORDER[:index])
    inside = done + STAGE_WEIGHTS.get(stage, 0) * (step / max(total, 1))
    if window is not None:
        inside = 100.0 * (min(window[0], window[1] - 1) + inside / 100.0) / window[1]
    return min(99.0, inside)
