"""A worker: one loaded pipeline that claims jobs from the job store and runs them, in the server's process (`h3gen
serve`, one worker) or a process of its own (`h3gen worker`, many per fleet).

- It claims the oldest queued job it can serve (`capabilities`), holding a lease it renews on a heartbeat thread; a
  worker that dies stops renewing, and the job is taken back (`job_recovery.take_back_lost_jobs`: re-queued once,
  then failed saying how often its worker was lost), without the lost attempt's preview.
- Progress, the stage and its timings go to the store as the job runs (at most every `PROGRESS_SECONDS`, and at each
  stage change), so any API node answers for it; a cancellation asked for on any node is seen at the next progress
  point (each stage reports when it starts and at points inside it, at most a fraction of a second apart).
- Previews made while denoising go to the results folder (`JobFiles.write_preview`, by rename) and the job's row says
  when the latest was made, so any node serves them; the row also holds the time left, from the measured forwards.
- A failure of any kind fails that job only; the worker carries on.
- `stop(drain=True)` (SIGTERM) claims nothing more and lets the running job finish within `drain_seconds`; past
  that the job is stopped and handed back to the queue, so nothing is lost.
"""

import gc
import logging
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.errors import RequestError
from h3gen.options import TASKS
from h3gen.pipelines.h3 import MAX_SECONDS_LIMIT
from h3gen.server.job import DENOISE, PLAN, PREVIEW, WINDOW, Job, JobStatus, progress_of
from h3gen.server.job_recovery import take_back_lost_jobs

logger = logging.getLogger(__name__)

FAST_TIERS = ("fast", "fast+high")  # a model loaded with an FP8 tier serves only these (`RunOptions.request_quality`)
OTHER_TIERS = ("exact", "lossless", "high")
LEASE_SECONDS = 30.0  # a worker that has not renewed its lease for this long is taken for lost
PROGRESS_SECONDS = 0.25  # how often a running job's progress is written to the store at most
CANCEL_POLL_SECONDS = 0.1  # how often a running job's progress points ask the store whether it was cancelled
IDLE_POLL_SECONDS = 0.2  # how often an idle worker looks for a job
RECENT_JOBS = 10
# The stages after denoising, whose time the time-left estimate takes from the worker's last job.
AFTER_DENOISE = ("decode_video", "decode_audio", "write_mp4")


class JobCancelled(Exception):
    """Raised inside the engine's progress callback to stop a cancelled job at its next progress point."""


class WorkerStopping(Exception):
    """Raised inside the progress callback when the worker must hand its job back (a drain past its deadline)."""


class JobLost(Exception):
    """Raised inside the progress callback when the job is no longer this worker's (it stalled past its lease and
    the job was taken back): the attempt stops and touches neither the job's row nor its files."""


def capabilities_of(engine) -> dict:
    """What `engine` (an `H3Engine`) can run: its tasks, the quality tiers its load serves, its quantization, the
    longest clip and the adapters its LoRA folder holds."""
    options = getattr(engine, "options", None)
    quality = options.quality if options is not None else "lossless"
    folder = getattr(engine, "lora_folder", None)
    return {
        "tasks": list(getattr(engine, "tasks", TASKS)),
        "qualities": list(FAST_TIERS if quality.startswith("fast") else OTHER_TIERS),
        "quantization": options.quantization if options is not None else None,
        "max_seconds": getattr(engine, "max_seconds", MAX_SECONDS_LIMIT),
        "loras": sorted(folder.names()) if folder is not None else [],
        # What it runs on, for /health (a TP x Ulysses group names its degrees).
        "devices": engine.devices(),
    }


def can_serve(capabilities: dict, needs: dict) -> bool:
    """Whether a worker of `capabilities` can run a job that `needs` (see `needs_of`)."""
    return (
        needs.get("task", "t2va") in capabilities["tasks"]
        and needs.get("quality") in (None, *capabilities["qualities"])
        and float(needs.get("seconds") or 0) <= capabilities["max_seconds"]
        and set(needs.get("loras") or ()) <= set(capabilities["loras"])
    )


def missing_capability(live: list[dict], needs: dict) -> str | None:
    """What no worker of `live` (`JobStore.live_workers`) offers for a job that `needs`, worded for a 422; None when
    one of them can run it."""
    if any(can_serve(worker["capabilities"], needs) for worker in live):
        return None
    if not live:
        return "no worker is running"
    checks = (
        ("task", lambda c: needs["task"] in c["tasks"], f"task {needs['task']}"),
        ("quality", lambda c: needs["quality"] in (None, *c["qualities"]), f"quality {needs['quality']}"),
        ("seconds", lambda c: float(needs["seconds"]) <= c["max_seconds"], f"{needs['seconds']:g} s clips"),
        ("loras", lambda c: set(needs["loras"]) <= set(c["loras"]), f"the adapters {', '.join(needs['loras'])}"),
    )
    for _, offered, what in checks:
        if not any(offered(worker["capabilities"]) for worker in live):
            return f"no live worker serves {what}"
    return "no single live worker serves this combination of task, quality, length and adapters"


def needs_of(request: dict) -> dict:
    """What a normalized request (`H3Engine.validate`) asks of a worker."""
    return {
        "task": request.get("task", "t2va"),
        "quality": request.get("quality"),
        "seconds": request.get("seconds") or request.get("duration") or 0.0,
        "loras": [lora["name"] for lora in request.get("loras") or []],
    }


@dataclass
class _Running:
    """The job this worker runs now, as its progress callback sees it."""

    job: Job
    progress: float = 0.0
    stage: str | None = None
    stage_started: float = field(default_factory=time.perf_counter)
    last_report: float = field(default_factory=time.perf_counter)
    last_write: float = 0.0
    last_cancel_check: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    window: tuple[int, int] | None = None
    forward_seconds: float = 0.0  # the denoising forwards' measured time, and how many
    forwards_timed: int = 0
    denoise_ended: float | None = None  # when the current window's last forward ended
    cancel: threading.Event = field(default_factory=threading.Event)
    hand_back: threading.Event = field(default_factory=threading.Event)


class JobWorker:
    """Claims and runs jobs from `store` on `engine` (an `H3Engine`), writing results into `files` (`JobFiles`).

    `worker_id` names it in the store (default: host and a random suffix); `metrics` (optional) counts what it ran.
    `on_finished(job_id)` runs after each job (the server sweeps retention there). A worker whose model fails to
    load fails every job it is given with the reason when `fail_jobs_on_load_error` (a server's only worker),
    else stops (a fleet's worker: the others take the jobs)."""

    def __init__(
        self,
        store,
        engine,
        files,
        *,
        worker_id: str | None = None,
        metrics=None,
        lease_seconds: float = LEASE_SECONDS,
        on_finished=None,
        fail_jobs_on_load_error: bool = True,
    ):
        self.store, self.engine, self.files, self.metrics = store, engine, files, metrics
        self.worker_id = worker_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.lease_seconds = lease_seconds
        self.on_finished = on_finished
        self.fail_jobs_on_load_error = fail_jobs_on_load_error
        self.recent: deque[float] = deque(maxlen=RECENT_JOBS)  # seconds of the latest succeeded jobs
        self.tail_seconds: float | None = None  # the stages after denoising, per window, in the last succeeded job
        self.capabilities: dict | None = None
        self.running: _Running | None = None
        self.running_since = 0.0
        self._stopping = threading.Event()
        self._finished = threading.Event()  # the claim loop has ended (the heartbeat runs until then)
        self._wake = threading.Event()  # a job was submitted in this process: look for it now
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Run `serve_forever` on a thread of its own."""
        self._thread = threading.Thread(target=self.serve_forever, name="h3gen-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the worker's thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    def serve_forever(self) -> None:
        """Load the model, register, then claim and run jobs until `stop`."""
        self.engine.load()
        # The model and the libraries live as long as the worker: keep them out of the collections after each job,
        # which would otherwise walk them all while holding the GIL (a second or more, stalling every request).
        gc.collect()
        gc.freeze()
        if self.engine.load_error is None:
            self.capabilities = capabilities_of(self.engine)
            self.store.register_worker(self.worker_id, self.capabilities, socket.gethostname())
        elif not self.fail_jobs_on_load_error:
            logger.error("worker %s: the model failed to load (%s); stopping", self.worker_id, self.engine.load_error)
            return
        self._beat = threading.Thread(target=self._heartbeat, name="h3gen-heartbeat", daemon=True)
        self._beat.start()
        try:
            while not self._stopping.is_set():
                take_back_lost_jobs(self.store, self.files)
                if self.capabilities is not None:
                    job = self.store.claim(
                        self.worker_id, lambda needs: can_serve(self.capabilities, needs), self.lease_seconds
                    )
                else:  # the model failed to load: each job fails, saying why (`_run`)
                    job = self.store.claim(self.worker_id, lambda needs: True, self.lease_seconds)
                if job is None:
                    self._wake.wait(IDLE_POLL_SECONDS)
                    self._wake.clear()
                    continue
                self._run(job)
        finally:
            self._finished.set()
            self.store.unregister_worker(self.worker_id)

    def wake(self) -> None:
        """Look for a job now rather than at the next poll (the server calls it when it queues one)."""
        self._wake.set()

    def stop(self, *, drain: bool = False, drain_seconds: float = 60.0, timeout: float = 10.0) -> None:
        """Claim nothing more. With `drain` the running job may finish within `drain_seconds`; otherwise (or past
        that) it is stopped at its next progress point and handed back to the queue."""
        self._drain_deadline = time.monotonic() + (drain_seconds if drain else 0.0)
        self._stopping.set()
        self._wake.set()
        running = self.running
        if running is not None and not drain:
            running.hand_back.set()
        if self._thread is not None:
            self._thread.join((drain_seconds if drain else 0.0) + timeout)

    def _heartbeat(self) -> None:
        """Renew the running job's lease (a third of a lease apart) and pass on cancellations asked for elsewhere, until
        the claim loop ends (a draining worker keeps its lease)."""
        while not self._finished.wait(self.lease_seconds / 3):
            try:
                for job_id in self.store.heartbeat(self.worker_id, self.lease_seconds):
                    running = self.running
                    if running is not None and running.job.id == job_id:
                        running.cancel.set()
            except Exception:  # a store that is briefly unreachable: the next beat tries again
                logger.exception("worker %s: heartbeat failed", self.worker_id)
            running = self.running
            if running is not None and self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                running.hand_back.set()

    # ------------------------------------------------------------------ one job

    def _report(self, running: _Running):
        """The engine's progress callback for `running`: live progress into the store, cancellation points."""
        job_id = running.job.id

        def report(stage: str, step: int, total: int, preview=None) -> None:
            if stage == PREVIEW:  # never raises: a preview that cannot be written costs the job nothing
                self._keep_preview(job_id, preview)
                return
            if running.hand_back.is_set():
                raise WorkerStopping()
            now = time.perf_counter()
            if now - running.last_cancel_check >= CANCEL_POLL_SECONDS:
                running.last_cancel_check = now
                if self.store.cancel_requested(job_id):
                    running.cancel.set()
            if running.cancel.is_set():
                raise JobCancelled()
            if stage == WINDOW:  # a clip over 15 s: which window runs (its stages report as a plain job's)
                running.window = (step, total)
                return
            changed = stage != running.stage
            if changed:
                # A stage that runs again (in the next window of a long clip) adds to its time.
                running.stage, running.stage_started = stage, now - running.timings.get(stage, 0.0)
            elif stage == DENOISE and step > 0:
                running.forward_seconds += now - running.last_report
                running.forwards_timed += 1
                if self.metrics is not None:
                    self.metrics.observe_step(now - running.last_report)
            if stage == DENOISE:
                running.denoise_ended = now if step >= total else None
            running.last_report = now
            running.timings[stage] = round(now - running.stage_started, 4)
            running.progress = max(running.progress, progress_of(stage, step, total, running.window))
            if changed or now - running.last_write >= PROGRESS_SECONDS:
                running.last_write = now
                window = None if running.window is None else list(running.window)
                held = self.store.update_held(
                    job_id,
                    self.worker_id,
                    progress=round(running.progress, 2),
                    stage=stage,
                    timings=dict(running.timings),
                    current_window=window,
                    eta_seconds=self._time_left(running, stage, step, total, now),
                )
                if not held:
                    raise JobLost()

        return report

    def _keep_preview(self, job_id: str, preview) -> None:
        """Say in the job's row that a preview (`pipelines.h3.Preview`) was made, then write it where every node finds
        it; neither while the job is no longer this worker's."""
        try:
            made = {"made_at": time.time(), "seconds": round(preview.seconds, 4), **preview.describe()}
            if self.store.update_held(job_id, self.worker_id, preview=made):
                self.files.write_preview(job_id, preview.jpeg())
        except Exception:
            logger.exception("job %s: the preview could not be kept", job_id)

    def _time_left(self, running: _Running, stage: str, step: int, total: int, now: float) -> float | None:
        """Seconds left: the forwards to come at the mean measured forward, plus the stages after denoising as they
        took in this worker's last job (each window has them); None before the first forward is measured."""
        if running.forwards_timed == 0:
            return None
        per_forward = running.forward_seconds / running.forwards_timed
        index, count = running.window or (0, 1)
        forwards = running.job.request.get("forwards") or 0
        tail = self.tail_seconds if self.tail_seconds is not None else 0.1 * per_forward * max(forwards, 1)
        windows_after = max(count - index - 1, 0)
        left = windows_after * (forwards * per_forward + tail)
        if stage == DENOISE:
            left += max(total - step, 0) * per_forward + tail
        elif stage in AFTER_DENOISE:
            left += tail if running.denoise_ended is None else max(tail - (now - running.denoise_ended), 0.0)
        else:  # a window's stages before its denoising
            left += forwards * per_forward + tail
        return round(left, 2)

    def _run(self, job: Job) -> None:
        running = _Running(job)
        self.running, self.running_since = running, time.monotonic()
        started = time.perf_counter()
        result = self.files.result(job.id)
        status, error, handed_back = JobStatus.SUCCEEDED, None, False
        try:
            report = self._report(running)
            if self.engine.load_error:
                raise RuntimeError(f"the model failed to load: {self.engine.load_error}")
            request, uploads = job.request, {k: Path(v) for k, v in job.uploads.items()}
            shown = request  # the request as the job's status shows it
            if request.get("plan"):
                report(PLAN, 0, 1)
                planned = self.engine.plan(request, uploads)
                shown = request = request | {"planned_prompt": planned}
                self.store.update_held(job.id, self.worker_id, request=request)  # shown in the job's status from now on
                report(PLAN, 1, 1)
                request = request | {"prompt": planned}
            outcome = self.engine.run(request, uploads, result, report)  # written aside, renamed when verified
            if outcome:  # what the run reports (the step cache's cached_steps), shown with the request
                self.store.update_held(job.id, self.worker_id, request=shown | outcome)
            if running.cancel.is_set():
                raise JobCancelled()
        except JobLost:
            logger.warning("job %s was taken back from this worker (its lease ran out); this attempt stops", job.id)
            return  # after `finally`: the GPU memory is freed as for any ending
        except WorkerStopping:
            handed_back = True
        except JobCancelled:
            status = JobStatus.CANCELLED
            handed_back = running.hand_back.is_set()  # ranks in lockstep stop a hand-back as a cancellation
        except RequestError as failure:
            status, error = JobStatus.FAILED, str(failure)
        except torch.cuda.OutOfMemoryError:
            status = JobStatus.FAILED
            error = "out of GPU memory: try fewer seconds, a smaller aspect ratio or fewer jobs"
        except Exception as failure:  # a failed job never takes the worker down
            logger.exception("job %s failed", job.id)
            status, error = JobStatus.FAILED, f"{type(failure).__name__}: {failure}"
        finally:
            self.running = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # a cancelled or failed job leaves no GPU memory behind
        if handed_back:
            # Before the job goes back (every preview written after that is the next attempt's), and only while it is
            # still this worker's: clearing the row's preview is the check.
            if self.store.update_held(job.id, self.worker_id, preview=None, eta_seconds=None):
                result.unlink(missing_ok=True)
                self.files.preview(job.id).unlink(missing_ok=True)
                self.store.hand_back(job.id, self.worker_id)
            return
        elapsed = time.perf_counter() - started
        if self.metrics is not None:
            for stage, seconds in running.timings.items():
                self.metrics.observe_stage(stage, seconds)
            self.metrics.count_finished(status, elapsed)
        if status == JobStatus.SUCCEEDED:
            self.recent.append(elapsed)
            windows = running.window[1] if running.window else 1
            self.tail_seconds = sum(running.timings.get(stage, 0.0) for stage in AFTER_DENOISE) / windows
        fields = {"status": status, "finished_at": time.time(), "timings": running.timings, "stage": None}
        fields.update(preview=None, eta_seconds=None)
        if status == JobStatus.SUCCEEDED:
            fields.update(progress=100.0, result_path=str(result), result_bytes=result.stat().st_size)
        else:
            fields["progress"] = round(running.progress, 2)
            if status == JobStatus.FAILED:
                fields["error"] = error
        if not self.store.finish(job.id, self.worker_id, **fields):
            # The files are the attempt's that took the job over: left as they are.
            logger.warning("job %s was taken over by another worker; this outcome is dropped", job.id)
            return
        self.files.preview(job.id).unlink(missing_ok=True)  # the video replaces it
        if status != JobStatus.SUCCEEDED:
            result.unlink(missing_ok=True)
        if status == JobStatus.CANCELLED:
            self.files.remove(job, result=False, uploads=True)
        # Otherwise a finished job keeps its uploads until it is deleted (a remix reuses them).
        if self.on_finished is not None:
            self.on_finished(job.id)
