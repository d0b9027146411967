"""The job manager: a bounded queue in front of one engine worker, with progress, cancellation, persistence and
retention. The REST API and the web UI are two faces of this one object.

- One job runs at a time on the engine thread; the others wait in submission order (at most `max_queue`).
- Jobs live in SQLite and MP4s in the results folder, so a restart keeps finished jobs, puts queued ones back in
  the queue (their uploads are kept on disk) and marks the one it interrupted as failed, saying why.
- A running job is cancelled at its next progress report (every denoising step); its partial files are removed.
- A failure of any kind fails that job only: the worker and the server carry on.
"""

import gc
import logging
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.errors import RequestError
from h3gen.server.metrics import Metrics
from h3gen.server.store import JobStore

logger = logging.getLogger(__name__)

# Share of the progress bar each stage owns (sums to 100).
STAGE_WEIGHTS = {"plan": 0, "encode_text": 4, "encode_conditions": 3, "denoise": 84, "decode_video": 4, "decode_audio": 3,
                 "write_mp4": 2}
STAGE_ORDER = tuple(STAGE_WEIGHTS)
FINISHED = ("succeeded", "failed", "cancelled")
INTERRUPTED = "interrupted: the server stopped while this job was running; submit it again"


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
    stage: str | None = None
    last_report: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)
    cancel: threading.Event = field(default_factory=threading.Event)


def progress_of(stage: str, step: int, total: int) -> float:
    """0-100 progress after `step` of `total` in `stage`, capped at 99 until the job is done."""
    index = STAGE_ORDER.index(stage) if stage in STAGE_ORDER else 0
    done = sum(STAGE_WEIGHTS[s] for s in STAGE_ORDER[:index])
    return min(99.0, done + STAGE_WEIGHTS.get(stage, 0) * (step / max(total, 1)))


class JobManager:
    """Accepts validated requests, runs them one at a time on `engine`, and answers for their state."""

    def __init__(self, engine, results_dir, *, max_queue: int = 16, retention_seconds: float = 7 * 86400,
                 max_results_bytes: int = 50 * 2**30):
        self.engine = engine
        self.results_dir = Path(results_dir)
        self.uploads_dir = self.results_dir / "uploads"
        self.uploads_dir.mkdir(parents=True, exist_ok=True)
        self.store = JobStore(self.results_dir / "jobs.sqlite3")
        self.max_queue = max_queue
        self.retention_seconds = retention_seconds
        self.max_results_bytes = max_results_bytes
        self.metrics = Metrics()
        self._queue: deque[str] = deque()
        self._cond = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._running: str | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover from the previous run, then load the model and serve the queue on the engine thread."""
        self.recover()
        self._thread = threading.Thread(target=self._worker, name="h3gen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for live in self._live.values():
                live.cancel.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        shutdown = getattr(self.engine, "shutdown", None)  # a multi-process engine releases its other ranks
        if shutdown is not None:
            shutdown()

    def recover(self) -> None:
        """Jobs the last run left running failed (it says why); queued ones go back in the queue, oldest first."""
        for job in self.store.list(limit=10**9, statuses=("running",)):
            self.store.update(job["id"], status="failed", error=INTERRUPTED, finished_at=time.time(), stage=None)
            self._remove_files(job, result=True, uploads=True)
        with self._cond:
            for job in self.store.list(limit=10**9, newest_first=False, statuses=("queued",)):
                self._queue.append(job["id"])
        self.sweep()

    # ------------------------------------------------------------------ requests

    def staging_dir(self) -> Path:
        """A fresh folder for one request's uploads before it is accepted."""
        folder = self.uploads_dir / f"staging-{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        return folder

    def submit(self, request: dict, uploads: dict[str, Path] | None = None) -> dict:
        """Queue a validated, normalized request; `uploads` (field -> file) are moved under the job's folder.
        Raises `QueueFull`."""
        uploads = uploads or {}
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(self.retry_after())
            job_id = uuid.uuid4().hex
            kept = {}
            if uploads:
                folder = self.uploads_dir / job_id
                folder.mkdir()
                for name, path in uploads.items():
                    target = folder / f"{name}{Path(path).suffix}"
                    shutil.move(str(path), target)
                    kept[name] = str(target)
            job = {"id": job_id, "status": "queued", "created_at": time.time(), "request": request,
                   "uploads": kept, "progress": 0.0, "timings": {}}
            self.store.insert(job)
            self._queue.append(job_id)
            self._cond.notify_all()
        self.metrics.count_submitted()
        return self.view(self.store.get(job_id))

    def retry_after(self) -> int:
        return max(1, int(self.metrics.mean_job_seconds() * (len(self._queue) + 1)))

    def cancel(self, job_id: str) -> dict | None:
        """Cancel a queued or running job and delete its files; delete a finished job entirely. Returns the job's
        last view, or None if there is no such job."""
        with self._cond:
            job = self.store.get(job_id)
            if job is None:
                return None
            if job["status"] == "queued":
                if job_id in self._queue:
                    self._queue.remove(job_id)
                self.store.update(job_id, status="cancelled", finished_at=time.time(), stage=None)
                self._remove_files(job, result=True, uploads=True)
                self.metrics.count_finished("cancelled", 0.0)
            elif job["status"] == "running":
                self._live[job_id].cancel.set()
                self.store.update(job_id, status="cancelled", finished_at=time.time())
            else:
                self._remove_files(job, result=True, uploads=True)
                self.store.delete(job_id)
                view = self.view(job)
                view["deleted"] = True
                return view
        return self.view(self.store.get(job_id))

    def wait(self, job_id: str, timeout: float) -> dict | None:
        """Block until the job is finished (or `timeout`); returns its view."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.store.get(job_id)
            if job is None or (job["status"] in FINISHED and job_id not in self._live):
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

    def view(self, job: dict) -> dict:
        """The public view of a stored job, with live progress for the running one."""
        live = self._live.get(job["id"])
        view = {key: job[key] for key in ("id", "status", "progress", "stage", "timings", "error", "request",
                                          "created_at", "started_at", "finished_at")}
        view["planned_prompt"] = (job["request"] or {}).get("planned_prompt")
        if live is not None and job["status"] == "running":
            view.update(progress=round(live.progress, 2), stage=live.stage, timings=dict(live.timings))
        if job["status"] == "queued":
            with self._cond:
                queue = list(self._queue)
            view["queue_position"] = queue.index(job["id"]) + 1 if job["id"] in queue else None
        if job["status"] == "succeeded":
            view["content_url"] = f"/v1/videos/{job['id']}/content"
        return view

    def result_path(self, job_id: str) -> Path | None:
        job = self.store.get(job_id)
        return Path(job["result_path"]) if job and job["result_path"] else None

    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> str | None:
        return self._running

    # ------------------------------------------------------------------ engine thread

    def _worker(self) -> None:
        self.engine.load()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job_id = self._queue.popleft()
                job = self.store.get(job_id)
                if job is None or job["status"] != "queued":
                    continue
                live = _Live()
                self._live[job_id] = live
                self._running = job_id
                self.store.update(job_id, status="running", started_at=time.time(), stage="starting")
            try:
                self._run(job, live)
            finally:
                with self._cond:
                    self._live.pop(job_id, None)
                    self._running = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # a cancelled or failed job leaves no GPU memory behind
                self.sweep()

    def _run(self, job: dict, live: _Live) -> None:
        job_id = job["id"]
        started = time.perf_counter()
        result = self.results_dir / f"{job_id}.mp4"

        def report(stage: str, step: int, total: int) -> None:
            # The pipeline reports after each unit of work, so the time since the last report belongs to `stage`.
            if live.cancel.is_set():
                raise JobCancelled()
            now = time.perf_counter()
            elapsed, live.last_report = now - live.last_report, now
            live.timings[stage] = round(live.timings.get(stage, 0.0) + elapsed, 4)
            if stage == "denoise":
                self.metrics.observe_step(elapsed)
            live.stage = stage
            live.progress = progress_of(stage, step, total)

        status, error = "succeeded", None
        try:
            if self.engine.load_error:
                raise RuntimeError(f"the model failed to load: {self.engine.load_error}")
            request, uploads = job["request"], {k: Path(v) for k, v in job["uploads"].items()}
            if request.get("plan"):
                report("plan", 0, 1)
                planned = self.engine.plan(request, uploads)
                request = request | {"planned_prompt": planned}
                self.store.update(job_id, request=request)  # shown in the job's status from now on
                report("plan", 1, 1)
                request = request | {"prompt": planned}
            self.engine.run(request, uploads, result, report)
            if live.cancel.is_set():
                raise JobCancelled()
        except JobCancelled:
            status = "cancelled"
        except RequestError as failure:
            status, error = "failed", str(failure)
        except torch.cuda.OutOfMemoryError:
            status, error = "failed", "out of GPU memory: try fewer seconds, a smaller aspect ratio or fewer jobs"
        except Exception as failure:  # a failed job never takes the worker down
            logger.exception("job %s failed", job_id)
            status, error = "failed", f"{type(failure).__name__}: {failure}"

        elapsed = time.perf_counter() - started
        for stage, seconds in live.timings.items():
            self.metrics.observe_stage(stage, seconds)
        self.metrics.count_finished(status, elapsed)
        fields = {"status": status, "finished_at": time.time(), "timings": live.timings, "stage": None}
        if status == "succeeded":
            fields.update(progress=100.0, result_path=str(result), result_bytes=result.stat().st_size)
        else:
            fields.update(error=error, progress=round(live.progress, 2))
            result.unlink(missing_ok=True)
        if status == "cancelled":
            fields.pop("error")
        self.store.update(job_id, **fields)
        self._remove_files(job, result=False, uploads=True)

    # ------------------------------------------------------------------ files

    def _remove_files(self, job: dict, *, result: bool, uploads: bool) -> None:
        if result and job.get("result_path"):
            Path(job["result_path"]).unlink(missing_ok=True)
        if result:
            (self.results_dir / f"{job['id']}.mp4").unlink(missing_ok=True)
        if uploads:
            shutil.rmtree(self.uploads_dir / job["id"], ignore_errors=True)

    def sweep(self) -> None:
        """Retention: drop finished jobs older than `retention_seconds`, then the oldest results until the folder
        holds at most `max_results_bytes`. Stale upload staging folders (older than a day) go too."""
        now = time.time()
        finished = self.store.list(limit=10**9, newest_first=False, statuses=FINISHED)
        kept = []
        for job in finished:
            if job["finished_at"] and now - job["finished_at"] > self.retention_seconds:
                self._remove_files(job, result=True, uploads=True)
                self.store.delete(job["id"])
            else:
                kept.append(job)
        total = sum(job["result_bytes"] or 0 for job in kept)
        for job in kept:
            if total <= self.max_results_bytes:
                break
            if job["result_bytes"]:
                total -= job["result_bytes"]
                self._remove_files(job, result=True, uploads=True)
                self.store.delete(job["id"])
        for folder in self.uploads_dir.glob("staging-*"):
            if now - folder.stat().st_mtime > 86400:
                shutil.rmtree(folder, ignore_errors=True)
