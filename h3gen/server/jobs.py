"""The job manager: a bounded queue in front of one engine worker, with progress, cancellation, persistence and
retention. The REST API and the web UI are two faces of this one object.

- One job runs at a time on the engine thread; the others wait in submission order (at most `max_queue`).
- Jobs (`job.Job`) live in SQLite (`store.py`) and MP4s in the results folder (`job_files.py`), so a restart keeps
  finished jobs, puts queued ones back in the queue (their uploads are kept on disk) and marks the one it
  interrupted as failed, saying why; MP4s no row names are adopted back (`job_recovery.py`).
- A running job is cancelled at its next progress report (each stage reports when it starts and at points inside
  it, at most a fraction of a second apart); its partial files are removed.
- A failure of any kind fails that job only: the worker and the server carry on.
- One manager owns a results folder: it holds `<results>/.lock` (see `lock.py`) from construction to `stop()`, which
  also checkpoints and closes the database.
- Retention (`sweep`, `job_retention.py`) runs after every job and on a timer, so an idle server does not serve
  expired jobs.
"""

import gc
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.errors import RequestError
from h3gen.server import job_recovery, job_retention
from h3gen.server.job import DENOISE, FINISHED, INTERRUPTED, PLAN, STAGE_ORDER, WINDOW, Job, JobStatus, progress_of
from h3gen.server.job_files import JobFiles
from h3gen.server.lock import FolderLock
from h3gen.server.metrics import Metrics
from h3gen.server.store import open_store

__all__ = [
    "FINISHED",
    "INTERRUPTED",
    "STAGE_ORDER",
    "JobCancelled",
    "JobManager",
    "JobStatus",
    "QueueFull",
    "default_job_seconds",
    "progress_of",
]

logger = logging.getLogger(__name__)

CANCEL_ACK_SECONDS = 2.0  # how long DELETE waits for the engine to stop a running job before answering
RECENT_JOBS = 10  # how many recent job durations the Retry-After estimate averages


def default_job_seconds(model_path) -> float:
    """A first guess at one job's duration before any has run: 10 s plus 2 s per GB of transformer weights (the tiny
    demo about 10 s on a CPU, the released 62 GB checkpoint about two minutes on one H200)."""
    size = 0
    if model_path is not None:
        for folder in Path(model_path).glob("transformer*"):
            size += sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    return 10.0 + 2.0 * size / 1e9


class QueueFull(Exception):
    """The queue holds `max_queue` jobs already; `retry_after` is a guess in seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry in about {retry_after} s")
        self.retry_after = retry_after


class JobCancelled(Exception):
    """Raised inside the engine's progress callback to stop a cancelled job at its next step."""


@dataclass
class _Live:
    """What the engine thread knows about the running job that the database does not have yet."""

    progress: float = 0.0
    stage: str | None = None  # the stage running now (each stage reports when it starts)
    stage_started: float = field(default_factory=time.perf_counter)
    last_report: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    cancel: threading.Event = field(default_factory=threading.Event)
    cancelled_by_client: bool = False  # False when the server's shutdown stopped it
    done: threading.Event = field(default_factory=threading.Event)  # set once the worker has written the outcome
    window: tuple[int, int] | None = None  # (index, count) of the window running, for a clip made in windows


class JobManager:
    """Accepts validated requests, runs them one at a time on `engine`, and answers for their state.

    Construction takes the results folder's lock (raises `lock.FolderBusy` naming the holder); `owner` says what
    this server is (e.g. its URL) to whoever finds the folder taken. `sweep_seconds` is the retention timer's period.
    `get`, `list`, `wait`, `submit` and `cancel` answer with a job's public view (`view`), a dict as the routes show
    it; `store` holds the `Job`s themselves.
    """

    def __init__(
        self,
        engine,
        results_dir,
        *,
        max_queue: int = 16,
        retention_seconds: float = 7 * 86400,
        max_results_bytes: int = 50 * 2**30,
        sweep_seconds: float = 60.0,
        owner: str = "",
    ):
        self.engine = engine
        self.files = JobFiles(results_dir)
        self.results_dir = self.files.results_dir
        self.uploads_dir = self.files.uploads_dir
        self._folder_lock = FolderLock(self.results_dir, owner)
        self._folder_lock.acquire()
        try:
            self.uploads_dir.mkdir(parents=True, exist_ok=True)
            self.store = open_store(self.results_dir)
        except BaseException:
            self._folder_lock.release()
            raise
        self.max_queue = max_queue
        self.retention_seconds = retention_seconds
        self.max_results_bytes = max_results_bytes
        self.sweep_seconds = sweep_seconds
        self.metrics = Metrics()
        self._queue: deque[str] = deque()
        self._cond = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._running: str | None = None
        self._running_since = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds of the latest succeeded jobs
        self._stopping = False
        self._stopped = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._sweeper: job_retention.SweepTimer | None = None
        self._sweep_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover from the previous run, then load the model and serve the queue on the engine thread; retention
        runs every `sweep_seconds` on its own thread."""
        self.recover()
        self._thread = threading.Thread(target=self._worker, name="h3gen-engine", daemon=True)
        self._thread.start()
        self._sweeper = job_retention.SweepTimer(self.sweep, self.sweep_seconds)
        self._sweeper.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the running job (it is recorded as interrupted; queued ones stay queued for the next start), stop
        the threads, checkpoint and close the database, and release the folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with self._cond:
            self._stopping = True
            for live in self._live.values():
                live.cancel.set()
            self._cond.notify_all()
        if self._sweeper is not None:
            self._sweeper.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sweeper is not None:
            self._sweeper.join(timeout)
        shutdown = getattr(self.engine, "shutdown", None)  # a multi-process engine releases its other ranks
        if shutdown is not None:
            shutdown()
        gc.unfreeze()  # what the worker froze is collectable again (interpreter exit frees it normally)
        with self._sweep_lock:
            self._closed = True
            self.store.close()
        self._folder_lock.release()

    def recover(self) -> None:
        """Take back what the last run left (`job_recovery`): its queued jobs, oldest first, and its recent run
        times; then sweep."""
        found = job_recovery.recover(self.store, self.files, recent=RECENT_JOBS)
        with self._cond:
            self._queue.extend(job_id for job_id in found.queued if job_id not in self._queue)
        self._recent.extend(found.recent)
        self.sweep()

    # ------------------------------------------------------------------ requests

    def staging_dir(self) -> Path:
        """A fresh folder for one request's uploads before it is accepted."""
        return self.files.staging_dir()

    def submit(self, request: dict, uploads: dict[str, Path] | None = None) -> dict:
        """Queue a validated, normalized request; `uploads` (field -> file) are moved under the job's folder, and a
        staging folder (`staging_dir`) they leave empty is removed. Raises `QueueFull`."""
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(self.retry_after())
            job_id = uuid.uuid4().hex
            kept = self.files.keep_uploads(job_id, uploads or {})
            job = Job(id=job_id, status=JobStatus.QUEUED, created_at=time.time(), request=request, uploads=kept)
            self.store.insert(job)
            self._queue.append(job_id)
            self._cond.notify_all()
        self.metrics.count_submitted()
        return self.view(self.store.get(job_id))

    def mean_job_seconds(self) -> float:
        """The average of the latest jobs' run times (queue wait excluded), or `default_job_seconds` with none."""
        recent = list(self._recent)
        if recent:
            return sum(recent) / len(recent)
        return default_job_seconds(getattr(self.engine, "model_path", None))

    def retry_after(self) -> int:
        """Seconds until a full queue likely has room again: a place frees when the running job ends, so what is left
        of it by the recent average (at least a tenth of a job; a whole job while none runs)."""
        mean = self.mean_job_seconds()
        left = mean
        if self._running is not None:
            left = max(mean - (time.monotonic() - self._running_since), mean / 10)
        return max(1, math.ceil(left))

    def cancel(self, job_id: str) -> dict | None:
        """Cancel a queued or running job and delete its files; delete a finished job entirely. Returns the job's
        view after the cancel (a running job's once the engine has stopped it, or after `CANCEL_ACK_SECONDS`), or
        None if there is no such job."""
        live = None
        with self._cond:
            job = self.store.get(job_id)
            if job is None:
                return None
            if job.status == JobStatus.RUNNING:
                live = self._live.get(job_id)
                if live is None:  # the row says running, yet this server's engine is not running it
                    job.status = JobStatus.QUEUED
            if job.status == JobStatus.QUEUED:
                if job_id in self._queue:
                    self._queue.remove(job_id)
                self.store.update(job_id, status=JobStatus.CANCELLED, finished_at=time.time(), stage=None)
                self.files.remove(job, result=True, uploads=True)
                self.metrics.count_finished(JobStatus.CANCELLED, 0.0)
            elif live is not None:
                live.cancelled_by_client = True
                live.cancel.set()
                self.store.update(job_id, status=JobStatus.CANCELLED, finished_at=time.time())
            else:
                self.files.remove(job, result=True, uploads=True)
                self.store.delete(job_id)
                view = self.view(job)
                view["deleted"] = True
                return view
        if live is not None:
            live.done.wait(CANCEL_ACK_SECONDS)
        return self.get(job_id)

    def wait(self, job_id: str, timeout: float) -> dict | None:
        """Block until the job is finished (or `timeout`); returns its view."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.store.get(job_id)
            if job is None or (job.finished and job_id not in self._live):
                return self.view(job) if job else None
            time.sleep(0.05)
        return self.get(job_id)

    # ------------------------------------------------------------------ views

    def get(self, job_id: str) -> dict | None:
        job = self.store.get(job_id)
        return self.view(job) if job else None

    def list(self, *, limit: int = 20, after: str | None = None, newest_first: bool = True) -> tuple[list[dict], bool]:
        rows = self.store.list(limit=limit + 1, after=after, newest_first=newest_first)
        return [self.view(r) for r in rows[:limit]], len(rows) > limit

    def view(self, job: Job) -> dict:
        """The public view of a stored job, with live progress for the running one."""
        live = self._live.get(job.id)
        request = job.request or {}
        view = {
            "id": job.id,
            "status": job.status.value,
            "progress": job.progress,
            "stage": job.stage,
            "timings": job.timings,
            "error": job.error,
            "request": job.request,
            "created_at": job.created_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "planned_prompt": request.get("planned_prompt"),
            "cached_steps": request.get("cached_steps"),
        }
        if live is not None and job.status == JobStatus.RUNNING:
            view.update(progress=round(live.progress, 2), stage=live.stage, timings=dict(live.timings))
            if live.window is not None:  # "2/5": the window a clip over 15 s is making
                view["window"] = f"{min(live.window[0] + 1, live.window[1])}/{live.window[1]}"
        if job.status == JobStatus.QUEUED:
            with self._cond:
                queue = list(self._queue)
            view["queue_position"] = queue.index(job.id) + 1 if job.id in queue else None
        if job.status == JobStatus.SUCCEEDED:
            view["content_url"] = f"/v1/videos/{job.id}/content"
        return view

    def result_path(self, job_id: str) -> Path | None:
        job = self.store.get(job_id)
        return Path(job.result_path) if job and job.result_path else None

    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> str | None:
        return self._running

    # ------------------------------------------------------------------ engine thread

    def _worker(self) -> None:
        self.engine.load()
        # The model and the libraries live as long as the server: keep them out of the collections after each job,
        # which would otherwise walk them all while holding the GIL (a second or more, stalling every request).
        gc.collect()
        gc.freeze()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job_id = self._queue.popleft()
                job = self.store.get(job_id)
                if job is None or job.status != JobStatus.QUEUED:
                    continue
                live = _Live()
                self._live[job_id] = live
                self._running, self._running_since = job_id, time.monotonic()
                self.store.update(job_id, status=JobStatus.RUNNING, started_at=time.time(), stage="starting")
            try:
                self._run(job, live)
            finally:
                with self._cond:
                    self._live.pop(job_id, None)
                    self._running = None
                live.done.set()
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # a cancelled or failed job leaves no GPU memory behind
                if not self._stopping:
                    self.sweep()

    def _run(self, job: Job, live: _Live) -> None:
        job_id = job.id
        started = time.perf_counter()
        result = self.files.result(job_id)

        def report(stage: str, step: int, total: int) -> None:
            # Every stage reports when it starts (step 0) and after units of work inside it; each report is a
            # cancellation point. A stage's timing runs from its first report to its last.
            if live.cancel.is_set():
                raise JobCancelled()
            if stage == WINDOW:  # a clip over 15 s: which window runs (its stages report as a plain job's)
                live.window = (step, total)
                return
            now = time.perf_counter()
            if stage != live.stage:
                # A stage that runs again (in the next window of a long clip) adds to its time.
                live.stage, live.stage_started = stage, now - live.timings.get(stage, 0.0)
            elif stage == DENOISE and step > 0:
                self.metrics.observe_step(now - live.last_report)
            live.last_report = now
            live.timings[stage] = round(now - live.stage_started, 4)
            live.progress = max(live.progress, progress_of(stage, step, total, live.window))

        status, error = JobStatus.SUCCEEDED, None
        try:
            if self.engine.load_error:
                raise RuntimeError(f"the model failed to load: {self.engine.load_error}")
            request, uploads = job.request, {k: Path(v) for k, v in job.uploads.items()}
            shown = request  # the request as the job's status shows it
            if request.get("plan"):
                report(PLAN, 0, 1)
                planned = self.engine.plan(request, uploads)
                shown = request = request | {"planned_prompt": planned}
                self.store.update(job_id, request=request)  # shown in the job's status from now on
                report(PLAN, 1, 1)
                request = request | {"prompt": planned}
            outcome = self.engine.run(request, uploads, result, report)
            if outcome:  # what the run reports (the step cache's cached_steps), shown with the request
                self.store.update(job_id, request=shown | outcome)
            if live.cancel.is_set():
                raise JobCancelled()
        except JobCancelled:
            status = JobStatus.CANCELLED
            if not live.cancelled_by_client:  # the server is shutting down
                status, error = JobStatus.FAILED, INTERRUPTED
        except RequestError as failure:
            status, error = JobStatus.FAILED, str(failure)
        except torch.cuda.OutOfMemoryError:
            status = JobStatus.FAILED
            error = "out of GPU memory: try fewer seconds, a smaller aspect ratio or fewer jobs"
        except Exception as failure:  # a failed job never takes the worker down
            logger.exception("job %s failed", job_id)
            status, error = JobStatus.FAILED, f"{type(failure).__name__}: {failure}"

        elapsed = time.perf_counter() - started
        for stage, seconds in live.timings.items():
            self.metrics.observe_stage(stage, seconds)
        self.metrics.count_finished(status, elapsed)
        if status == JobStatus.SUCCEEDED:
            self._recent.append(elapsed)
        fields = {"status": status, "finished_at": time.time(), "timings": live.timings, "stage": None}
        if status == JobStatus.SUCCEEDED:
            fields.update(progress=100.0, result_path=str(result), result_bytes=result.stat().st_size)
        else:
            fields["progress"] = round(live.progress, 2)
            if status == JobStatus.FAILED:
                fields["error"] = error
            result.unlink(missing_ok=True)
        self.store.update(job_id, **fields)
        if status == JobStatus.CANCELLED:
            self.files.remove(job, result=False, uploads=True)
        # Otherwise a finished job keeps its uploads until it is deleted (a remix reuses them).

    # ------------------------------------------------------------------ retention

    def sweep(self) -> None:
        """Retention (`job_retention.sweep`): drop finished jobs older than `retention_seconds`, then the oldest
        results until the folder holds at most `max_results_bytes`, then stale upload staging folders."""
        with self._sweep_lock:
            if not self._closed:
                job_retention.sweep(
                    self.store,
                    self.files,
                    retention_seconds=self.retention_seconds,
                    max_results_bytes=self.max_results_bytes,
                )
