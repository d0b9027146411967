"""The job manager: the REST API's and the web UI's view of the job queue, over one job store (`store.py`: SQLite in
the results folder on one box, PostgreSQL across machines) that the workers (`job_worker.py`) claim jobs from.

- Jobs wait in the store in submission order (at most `max_queue` queued); a worker claims the oldest one it can
  serve under a lease. With `local_worker` this manager runs one worker on its own engine (`h3gen serve`); a fleet's
  other workers are `h3gen worker` processes on the same store.
- Everything is answered from the store, so any API node answers for any job: status, progress, stage, queue
  position, cancellation (a running job stops at its worker's next progress point, a fraction of a second later).
- A job no live worker can serve is refused when submitted (422 naming what is missing), once any worker is live.
- A worker that is lost (killed, its machine gone) stops renewing its lease: its job is re-queued once, then failed
  saying so. On one box (SQLite) a restart takes back the jobs the previous run left running the same way.
- A failure of any kind fails that job only: the worker and the server carry on.
- On one box the manager owns the results folder: it holds `<results>/.lock` (see `lock.py`) from construction to
  `stop()`, which also closes the store. Nodes of a PostgreSQL fleet share the folder (a mount every node has).
- Retention (`sweep`, `job_retention.py`) runs after every job of the local worker and on a timer.
"""

import logging
import math
import threading
import time
import uuid
from collections import deque
from pathlib import Path

from h3gen.errors import RequestError
from h3gen.server import job_recovery, job_retention
from h3gen.server.job import FINISHED, STAGE_ORDER, Job, JobStatus, progress_of
from h3gen.server.job_files import JobFiles
from h3gen.server.job_worker import LEASE_SECONDS, JobCancelled, JobWorker, missing_capability, needs_of
from h3gen.server.lock import FolderLock
from h3gen.server.metrics import Metrics
from h3gen.server.store import open_store

__all__ = [
    "FINISHED",
    "STAGE_ORDER",
    "JobCancelled",
    "JobManager",
    "JobStatus",
    "QueueFull",
    "default_job_seconds",
    "progress_of",
]

logger = logging.getLogger(__name__)

CANCEL_ACK_SECONDS = 2.0  # how long DELETE waits for the worker to stop a running job before answering
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


class JobManager:
    """Accepts validated requests into the job store and answers for their state.

    `store`: a `postgresql://` URL for a fleet, or None for SQLite in `results_dir` (then construction takes the
    folder's lock, raising `lock.FolderBusy` naming the holder; `owner` says what this server is to whoever finds the
    folder taken). `fleet` names the fleet the store must belong to. `local_worker` runs one worker on `engine` in
    this process; without it the jobs wait for `h3gen worker` processes. `sweep_seconds` is the retention timer's
    period. `get`, `list`, `wait`, `submit` and `cancel` answer with a job's public view (`view`), a dict as the
    routes show it; `store` holds the `Job`s themselves.
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
        store: str | None = None,
        fleet: str = "h3gen",
        local_worker: bool = True,
        lease_seconds: float = LEASE_SECONDS,
    ):
        self.engine = engine
        self.files = JobFiles(results_dir)
        self.results_dir = self.files.results_dir
        self.uploads_dir = self.files.uploads_dir
        self.shared = store is not None  # a fleet's store: other nodes use this folder and store too
        self._folder_lock = None if self.shared else FolderLock(self.results_dir, owner)
        if self._folder_lock is not None:
            self._folder_lock.acquire()
        try:
            self.uploads_dir.mkdir(parents=True, exist_ok=True)
            self.store = open_store(store or self.results_dir, fleet=fleet)
        except BaseException:
            if self._folder_lock is not None:
                self._folder_lock.release()
            raise
        self.max_queue = max_queue
        self.retention_seconds = retention_seconds
        self.max_results_bytes = max_results_bytes
        self.sweep_seconds = sweep_seconds
        self.lease_seconds = lease_seconds
        self.metrics = Metrics()
        self._recent: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds of the latest succeeded jobs
        self.worker = None
        if local_worker:
            self.worker = JobWorker(
                self.store,
                engine,
                self.files,
                metrics=self.metrics,
                lease_seconds=lease_seconds,
                on_finished=lambda job_id: self.sweep(),
            )
        self.started = False
        self._stopped = False
        self._closed = False
        self._sweeper: job_retention.SweepTimer | None = None
        self._sweep_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover from the previous run, start the local worker (it loads the model first), and sweep retention
        every `sweep_seconds` on a thread of its own."""
        self.started = True
        self.recover()
        if self.worker is not None:
            self.worker.start()
        self._sweeper = job_retention.SweepTimer(self.sweep, self.sweep_seconds)
        self._sweeper.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the local worker (its running job goes back to the queue for the next start or another worker),
        stop the timer, close the store and release the folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.stop()
        if self.worker is not None:
            self.worker.stop(timeout=timeout)
        if self._sweeper is not None:
            self._sweeper.join(timeout)
        shutdown = getattr(self.engine, "shutdown", None)  # a multi-process engine releases its other ranks
        if shutdown is not None:
            shutdown()
        with self._sweep_lock:
            self._closed = True
            self.store.close()
        if self._folder_lock is not None:
            self._folder_lock.release()

    def recover(self) -> None:
        """Put the store and the folder in order (`job_recovery`): on one box, the jobs the last run left running go
        back to the queue (or fail, their second time); then sweep."""
        found = job_recovery.recover(self.store, self.files, recent=RECENT_JOBS, owns_folder=not self.shared)
        self._recent.extend(found.recent)
        self.sweep()

    # ------------------------------------------------------------------ requests

    def staging_dir(self) -> Path:
        """A fresh folder for one request's uploads before it is accepted."""
        return self.files.staging_dir()

    def live_workers(self) -> list[dict]:
        """The workers that renewed their registration within a lease (`JobStore.live_workers`)."""
        return self.store.live_workers(self.lease_seconds)

    def check_servable(self, request: dict) -> None:
        """Refuse (`RequestError`, 422) a normalized request no live worker can serve, once any worker is live; a
        fleet whose workers are all still loading queues it."""
        live = self.live_workers()
        if not live:
            return
        missing = missing_capability(live, needs_of(request))
        if missing is not None:
            raise RequestError(f"no worker can run this job: {missing}.", "task")

    def submit(self, request: dict, uploads: dict[str, Path] | None = None) -> dict:
        """Queue a validated, normalized request; `uploads` (field -> file) are moved under the job's folder, and a
        staging folder (`staging_dir`) they leave empty is removed. Raises `QueueFull`, or `RequestError` when no
        live worker can serve it."""
        self.check_servable(request)
        if self.queue_depth() >= self.max_queue:  # the cheap answer; the insert below decides
            raise QueueFull(self.retry_after())
        job_id = uuid.uuid4().hex
        kept = self.files.keep_uploads(job_id, uploads or {})
        job = Job(
            id=job_id,
            status=JobStatus.QUEUED,
            created_at=time.time(),
            request=request,
            uploads=kept,
            needs=needs_of(request),
        )
        if not self.store.insert(job, max_queued=self.max_queue):
            self.files.remove(job, result=True, uploads=True)
            raise QueueFull(self.retry_after())
        if self.worker is not None:
            self.worker.wake()
        self.metrics.count_submitted()
        return self.view(self.store.get(job_id))

    def mean_job_seconds(self) -> float:
        """The average of the latest jobs' run times (queue wait excluded), or `default_job_seconds` with none."""
        recent = list(self.worker.recent) if self.worker is not None else []
        recent = recent or list(self._recent)
        if not recent:
            jobs = self.store.list(limit=RECENT_JOBS, statuses=(JobStatus.SUCCEEDED,))
            recent = [job.finished_at - job.started_at for job in jobs if job.started_at and job.finished_at]
        if recent:
            return sum(recent) / len(recent)
        return default_job_seconds(getattr(self.engine, "model_path", None))

    def retry_after(self) -> int:
        """Seconds until a full queue likely has room again: a place frees when a running job ends, so what is left
        of it by the recent average (at least a tenth of a job; a whole job while none runs)."""
        mean = self.mean_job_seconds()
        left = mean
        running = self.store.list(limit=1, newest_first=False, statuses=(JobStatus.RUNNING,))
        if running and running[0].started_at:
            left = max(mean - (time.time() - running[0].started_at), mean / 10)
        return max(1, math.ceil(left))

    def cancel(self, job_id: str) -> dict | None:
        """Cancel a queued or running job and delete its files; delete a finished job entirely. Returns the job's
        view after the cancel (a running job's once its worker has stopped it, or after `CANCEL_ACK_SECONDS`), or
        None if there is no such job."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job.finished:
            self.files.remove(job, result=True, uploads=True)
            self.store.delete(job_id)
            view = self.view(job)
            view["deleted"] = True
            return view
        status = self.store.request_cancel(job_id)
        if status == JobStatus.CANCELLED and job.status == JobStatus.QUEUED:
            self.files.remove(job, result=True, uploads=True)
            self.metrics.count_finished(JobStatus.CANCELLED, 0.0)
        elif status == JobStatus.RUNNING:
            running = self.worker.running if self.worker is not None else None
            if running is not None and running.job.id == job_id:
                running.cancel.set()  # this process's worker: no need to wait for its next look at the store
            elif job.worker_id not in {worker["id"] for worker in self.live_workers()}:
                # No live worker holds it (a row left running by a lost one): nobody would stop it.
                self.store.update(job_id, status=JobStatus.CANCELLED, finished_at=time.time(), stage=None)
                self.files.remove(job, result=True, uploads=True)
                return self.get(job_id)
            deadline = time.monotonic() + CANCEL_ACK_SECONDS
            while time.monotonic() < deadline:
                current = self.store.get(job_id)
                if current is None or current.finished:
                    break
                time.sleep(0.02)
        return self.get(job_id)

    def wait(self, job_id: str, timeout: float) -> dict | None:
        """Block until the job is finished (or `timeout`); returns its view."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.store.get(job_id)
            if job is None or job.finished:
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
        """The public view of a stored job."""
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
        if job.status == JobStatus.RUNNING and job.current_window:  # "2/5": the window a long clip is making
            index, count = job.current_window
            view["window"] = f"{min(index + 1, count)}/{count}"
        if job.status == JobStatus.RUNNING:
            view["eta_seconds"] = job.eta_seconds
            if job.preview:
                made = job.preview
                window = made.get("window")
                view["preview_at"] = made["made_at"]
                view["preview"] = {
                    "forward": made["forward"],
                    "forwards": made["forwards"],
                    "window": f"{window[0] + 1}/{window[1]}" if window else None,
                    "seconds": made.get("seconds"),
                    "url": f"/v1/videos/{job.id}/content?variant=preview",
                }
        if job.status == JobStatus.QUEUED:
            queue = [queued.id for queued in self.store.list(newest_first=False, statuses=(JobStatus.QUEUED,))]
            view["queue_position"] = queue.index(job.id) + 1 if job.id in queue else None
        if job.status == JobStatus.SUCCEEDED:
            view["content_url"] = f"/v1/videos/{job.id}/content"
        return view

    def result_path(self, job_id: str) -> Path | None:
        job = self.store.get(job_id)
        return Path(job.result_path) if job and job.result_path else None

    def queue_depth(self) -> int:
        return self.store.count_by_status().get(JobStatus.QUEUED.value, 0)

    @property
    def running(self) -> str | None:
        """The id of the oldest running job, or None."""
        jobs = self.store.list(limit=1, newest_first=False, statuses=(JobStatus.RUNNING,))
        return jobs[0].id if jobs else None

    def queue_by_task(self) -> dict[str, int]:
        """Queued jobs per task."""
        counts: dict[str, int] = {}
        for job in self.store.list(statuses=(JobStatus.QUEUED,)):
            task = job.needs.get("task", "t2va")
            counts[task] = counts.get(task, 0) + 1
        return counts

    def workers_by_task(self) -> dict[str, int]:
        """Live workers per task they serve."""
        counts: dict[str, int] = {}
        for worker in self.live_workers():
            for task in worker["capabilities"].get("tasks", ()):
                counts[task] = counts.get(task, 0) + 1
        return counts

    @property
    def ready(self) -> bool:
        """Whether a job can run now: the local worker's model is loaded, or (without one) a worker is live."""
        if self.worker is not None:
            return self.engine.ready
        return bool(self.live_workers())

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
