"""The job manager: a bounded queue in front of one engine worker, with progress, cancellation, persistence and
retention. The REST API and the web UI are two faces of this one object.

- One job runs at a time on the engine thread; the others wait in submission order (at most `max_queue`).
- Jobs live in SQLite and MP4s in the results folder, so a restart keeps finished jobs, puts queued ones back in
  the queue (their uploads are kept on disk) and marks the one it interrupted as failed, saying why.
- A running job is cancelled at its next progress report (each stage reports when it starts and at points inside
  it, at most a fraction of a second apart); its partial files are removed.
- A failure of any kind fails that job only: the worker and the server carry on.
- One manager owns a results folder: it holds `<results>/.lock` (see `lock.py`) from construction to `stop()`, which
  also checkpoints and closes the database.
- Retention (`sweep`) runs after every job and on a timer, so an idle server does not serve expired jobs.
- On start, MP4s in the results folder that no row names (the database was lost or damaged) are adopted back as
  succeeded jobs whose request holds what the file tells (size, frames, duration, audio rate; `adopted: true`); files
  that do not decode, and leftovers of interrupted writes, are removed.
"""

import gc
import logging
import math
import re
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.errors import RequestError
from h3gen.media import MediaError, probe_mp4
from h3gen.server.lock import FolderLock
from h3gen.server.metrics import Metrics
from h3gen.server.store import JobStore

logger = logging.getLogger(__name__)

# Share of the progress bar each stage owns (sums to 100).
STAGE_WEIGHTS = {
    "plan": 0,
    "encode_text": 4,
    "encode_conditions": 3,
    "denoise": 84,
    "decode_video": 4,
    "decode_audio": 3,
    "write_mp4": 2,
}
STAGE_ORDER = tuple(STAGE_WEIGHTS)
FINISHED = ("succeeded", "failed", "cancelled")
INTERRUPTED = "interrupted: the server stopped while this job was running; submit it again"
CANCEL_ACK_SECONDS = 2.0  # how long DELETE waits for the engine to stop a running job before answering
STALE_STAGING_SECONDS = 3600.0  # a request's upload folder older than this belongs to no request any more
RECENT_JOBS = 10  # how many recent job durations the Retry-After estimate averages
_JOB_FILE = re.compile(r"^[0-9a-f]{32}$")


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


def progress_of(stage: str, step: int, total: int, window: tuple[int, int] | None = None) -> float:
    """0-100 progress after `step` of `total` in `stage`, capped at 99 until the job is done. A clip made in
    windows (`window` = (index, count)) gives each window an equal share, its stages inside it."""
    index = STAGE_ORDER.index(stage) if stage in STAGE_ORDER else 0
    done = sum(STAGE_WEIGHTS[s] for s in STAGE_ORDER[:index])
    inside = done + STAGE_WEIGHTS.get(stage, 0) * (step / max(total, 1))
    if window is not None:
        inside = 100.0 * (min(window[0], window[1] - 1) + inside / 100.0) / window[1]
    return min(99.0, inside)


class JobManager:
    """Accepts validated requests, runs them one at a time on `engine`, and answers for their state.

    Construction takes the results folder's lock (raises `lock.FolderBusy` naming the holder); `owner` says what
    this server is (e.g. its URL) to whoever finds the folder taken. `sweep_seconds` is the retention timer's period.
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
        self.results_dir = Path(results_dir)
        self.uploads_dir = self.results_dir / "uploads"
        self._folder_lock = FolderLock(self.results_dir, owner)
        self._folder_lock.acquire()
        try:
            self.uploads_dir.mkdir(parents=True, exist_ok=True)
            self.store = JobStore(self.results_dir / "jobs.sqlite3")
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
        self._sweeper: threading.Thread | None = None
        self._sweep_lock = threading.Lock()
        self._sweep_stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover from the previous run, then load the model and serve the queue on the engine thread; retention
        runs every `sweep_seconds` on its own thread."""
        self.recover()
        self._thread = threading.Thread(target=self._worker, name="h3gen-engine", daemon=True)
        self._thread.start()
        self._sweeper = threading.Thread(target=self._sweep_timer, name="h3gen-retention", daemon=True)
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
        self._sweep_stop.set()
        for thread in (self._thread, self._sweeper):
            if thread is not None:
                thread.join(timeout)
        shutdown = getattr(self.engine, "shutdown", None)  # a multi-process engine releases its other ranks
        if shutdown is not None:
            shutdown()
        gc.unfreeze()  # what the worker froze is collectable again (interpreter exit frees it normally)
        with self._sweep_lock:
            self._closed = True
            self.store.close()
        self._folder_lock.release()

    def recover(self) -> None:
        """Jobs the last run left running failed (it says why); queued ones go back in the queue, oldest first;
        MP4s no row names are adopted; upload folders no queued job owns and half-written files are removed."""
        for job in self.store.list(limit=10**9, statuses=("running",)):
            self.store.update(job["id"], status="failed", error=INTERRUPTED, finished_at=time.time(), stage=None)
            self._remove_files(job, result=True, uploads=True)
        with self._cond:
            for job in self.store.list(limit=10**9, newest_first=False, statuses=("queued",)):
                self._queue.append(job["id"])
        for job in self.store.list(limit=RECENT_JOBS, statuses=("succeeded",))[::-1]:
            if job["started_at"] and job["finished_at"]:
                self._recent.append(job["finished_at"] - job["started_at"])
        for partial in self.results_dir.glob(".*.mp4.partial-*"):
            partial.unlink(missing_ok=True)
        queued = set(self._queue)
        for folder in self.uploads_dir.iterdir():
            if _JOB_FILE.match(folder.name) and folder.name not in queued:
                shutil.rmtree(folder, ignore_errors=True)
        self._adopt_orphans()
        self.sweep()

    def _adopt_orphans(self) -> None:
        """Give every `<job id>.mp4` without a row a succeeded row with what the file tells; remove the ones that
        do not decode."""
        known = {job["id"] for job in self.store.list(limit=10**9)}
        for path in sorted(self.results_dir.glob("*.mp4"), key=lambda item: item.stat().st_mtime):
            job_id = path.stem
            if not _JOB_FILE.match(job_id) or job_id in known:
                continue
            try:
                info = probe_mp4(path)
            except MediaError as error:
                logger.warning("removed %s: no job names it and it does not decode (%s)", path.name, error)
                path.unlink(missing_ok=True)
                continue
            when = path.stat().st_mtime
            request = {
                "adopted": True,
                "width": info.width,
                "height": info.height,
                "num_frames": info.num_frames,
                "fps": info.fps,
                "duration": round(info.video_seconds, 4),
                "audio_sample_rate": info.sample_rate,
            }
            self.store.insert(
                {
                    "id": job_id,
                    "status": "succeeded",
                    "created_at": when,
                    "finished_at": when,
                    "request": request,
                    "progress": 100.0,
                    "timings": {},
                    "uploads": {},
                    "result_path": str(path),
                    "result_bytes": path.stat().st_size,
                }
            )
            logger.warning(
                "adopted %s: no job named it (the job database was lost or damaged); it is served as a "
                "succeeded job whose request is unknown",
                path.name,
            )

    # ------------------------------------------------------------------ requests

    def staging_dir(self) -> Path:
        """A fresh folder for one request's uploads before it is accepted."""
        folder = self.uploads_dir / f"staging-{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        return folder

    def submit(self, request: dict, uploads: dict[str, Path] | None = None) -> dict:
        """Queue a validated, normalized request; `uploads` (field -> file) are moved under the job's folder, and a
        staging folder (`staging_dir`) they leave empty is removed. Raises `QueueFull`."""
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
                for staging in {Path(path).parent for path in uploads.values()}:
                    if staging.parent == self.uploads_dir and staging.name.startswith("staging-"):
                        shutil.rmtree(staging, ignore_errors=True)
            job = {
                "id": job_id,
                "status": "queued",
                "created_at": time.time(),
                "request": request,
                "uploads": kept,
                "progress": 0.0,
                "timings": {},
            }
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
            if job["status"] == "running":
                live = self._live.get(job_id)
                if live is None:  # the row says running, yet this server's engine is not running it
                    job["status"] = "queued"
            if job["status"] == "queued":
                if job_id in self._queue:
                    self._queue.remove(job_id)
                self.store.update(job_id, status="cancelled", finished_at=time.time(), stage=None)
                self._remove_files(job, result=True, uploads=True)
                self.metrics.count_finished("cancelled", 0.0)
            elif live is not None:
                live.cancelled_by_client = True
                live.cancel.set()
                self.store.update(job_id, status="cancelled", finished_at=time.time())
            else:
                self._remove_files(job, result=True, uploads=True)
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
        view = {
            key: job[key]
            for key in (
                "id",
                "status",
                "progress",
                "stage",
                "timings",
                "error",
                "request",
                "created_at",
                "started_at",
                "finished_at",
            )
        }
        view["planned_prompt"] = (job["request"] or {}).get("planned_prompt")
        view["cached_steps"] = (job["request"] or {}).get("cached_steps")
        if live is not None and job["status"] == "running":
            view.update(progress=round(live.progress, 2), stage=live.stage, timings=dict(live.timings))
            if live.window is not None:  # "2/5": the window a clip over 15 s is making
                view["window"] = f"{min(live.window[0] + 1, live.window[1])}/{live.window[1]}"
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
                if job is None or job["status"] != "queued":
                    continue
                live = _Live()
                self._live[job_id] = live
                self._running, self._running_since = job_id, time.monotonic()
                self.store.update(job_id, status="running", started_at=time.time(), stage="starting")
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

    def _run(self, job: dict, live: _Live) -> None:
        job_id = job["id"]
        started = time.perf_counter()
        result = self.results_dir / f"{job_id}.mp4"

        def report(stage: str, step: int, total: int) -> None:
            # Every stage reports when it starts (step 0) and after units of work inside it; each report is a
            # cancellation point. A stage's timing runs from its first report to its last.
            if live.cancel.is_set():
                raise JobCancelled()
            if stage == "window":  # a clip over 15 s: which window runs (its stages report as a plain job's)
                live.window = (step, total)
                return
            now = time.perf_counter()
            if stage != live.stage:
                # A stage that runs again (in the next window of a long clip) adds to its time.
                live.stage, live.stage_started = stage, now - live.timings.get(stage, 0.0)
            elif stage == "denoise" and step > 0:
                self.metrics.observe_step(now - live.last_report)
            live.last_report = now
            live.timings[stage] = round(now - live.stage_started, 4)
            live.progress = max(live.progress, progress_of(stage, step, total, live.window))

        status, error = "succeeded", None
        try:
            if self.engine.load_error:
                raise RuntimeError(f"the model failed to load: {self.engine.load_error}")
            request, uploads = job["request"], {k: Path(v) for k, v in job["uploads"].items()}
            shown = request  # the request as the job's status shows it
            if request.get("plan"):
                report("plan", 0, 1)
                planned = self.engine.plan(request, uploads)
                shown = request = request | {"planned_prompt": planned}
                self.store.update(job_id, request=request)  # shown in the job's status from now on
                report("plan", 1, 1)
                request = request | {"prompt": planned}
            outcome = self.engine.run(request, uploads, result, report)
            if outcome:  # what the run reports (the step cache's cached_steps), shown with the request
                self.store.update(job_id, request=shown | outcome)
            if live.cancel.is_set():
                raise JobCancelled()
        except JobCancelled:
            status = "cancelled"
            if not live.cancelled_by_client:  # the server is shutting down
                status, error = "failed", INTERRUPTED
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
        if status == "succeeded":
            self._recent.append(elapsed)
        fields = {"status": status, "finished_at": time.time(), "timings": live.timings, "stage": None}
        if status == "succeeded":
            fields.update(progress=100.0, result_path=str(result), result_bytes=result.stat().st_size)
        else:
            fields.update(error=error, progress=round(live.progress, 2))
            result.unlink(missing_ok=True)
        if status == "cancelled":
            fields.pop("error")
        self.store.update(job_id, **fields)
        if status == "cancelled":
            self._remove_files(job, result=False, uploads=True)
        # Otherwise a finished job keeps its uploads until it is deleted (a remix reuses them).

    # ------------------------------------------------------------------ files

    def _remove_files(self, job: dict, *, result: bool, uploads: bool) -> None:
        if result and job.get("result_path"):
            Path(job["result_path"]).unlink(missing_ok=True)
        if result:
            (self.results_dir / f"{job['id']}.mp4").unlink(missing_ok=True)
        if uploads:
            shutil.rmtree(self.uploads_dir / job["id"], ignore_errors=True)

    def _sweep_timer(self) -> None:
        while not self._sweep_stop.wait(self.sweep_seconds):
            try:
                self.sweep()
            except Exception:  # a failed sweep is retried next period; it never stops the timer
                logger.exception("retention sweep failed")

    def sweep(self) -> None:
        """Retention: drop finished jobs older than `retention_seconds`, then the oldest results until the folder
        holds at most `max_results_bytes`. Upload staging folders older than `STALE_STAGING_SECONDS` go too."""
        with self._sweep_lock:
            if not self._closed:
                self._sweep()

    def _sweep(self) -> None:
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
            try:
                if now - folder.stat().st_mtime > STALE_STAGING_SECONDS:
                    shutil.rmtree(folder, ignore_errors=True)
            except FileNotFoundError:  # its request removed it meanwhile
                pass
