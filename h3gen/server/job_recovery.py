"""What a job manager finds on start, left by the run before it (a restart, a crash, a lost database).

- On one box (the manager owns the folder and its SQLite store), the jobs the last run left running lost their
  worker with it: they go back to the queue in their place (`take_back_lost_jobs`; a job lost a second time
  fails, saying so). In a fleet the other workers' leases decide that: each worker takes back the jobs whose lease
  ran out the same way. Either way the lost attempt's preview goes, so that the next attempt's is the only one.
- Queued and running jobs keep their uploads.
- The latest succeeded jobs' run times seed the Retry-After estimate.
- Half-written MP4s, and upload folders no queued job owns, are removed.
- MP4s in the results folder that no row names (the database was lost or damaged) are adopted back as succeeded jobs
  whose request holds what the file tells (size, frames, duration, audio rate; `adopted: true`); files that do not
  decode are removed.
"""

import logging
import math
import shutil
from dataclasses import dataclass, field

from h3gen.media import MediaError, probe_mp4
from h3gen.server.job import Job, JobStatus
from h3gen.server.job_files import JOB_ID, JobFiles
from h3gen.server.store import JobStore

logger = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What the manager takes back from the last run."""

    queued: list[str] = field(default_factory=list)  # ids of the jobs still queued, oldest first
    recent: list[float] = field(default_factory=list)  # run seconds of the latest succeeded jobs, oldest first


def take_back_lost_jobs(store: JobStore, files: JobFiles, now: float | None = None) -> list[tuple[str, JobStatus]]:
    """Take back the running jobs whose worker stopped renewing its lease before `now` (`JobStore.requeue_expired`:
    re-queued, or cancelled or failed) and remove each one's preview from the results folder. Returns each job
    taken back with its new status."""
    taken = store.requeue_expired(now=now)
    for job_id, _ in taken:
        files.preview(job_id).unlink(missing_ok=True)
    return taken


def recover(store: JobStore, files: JobFiles, *, recent: int, owns_folder: bool = True) -> Recovered:
    """Put the store and the results folder back in order after a restart (see the module's docstring); `recent`
    is how many of the latest succeeded jobs' run times to return. `owns_folder`: this manager is the only one on
    the folder and the store (one box); partial files and orphans are then its to clean up."""
    if owns_folder:
        for job_id, status in take_back_lost_jobs(store, files, now=math.inf):
            logger.warning("job %s was running when the server stopped: %s", job_id, status.value)
    found = Recovered(queued=[job.id for job in store.list(newest_first=False, statuses=(JobStatus.QUEUED,))])
    for job in store.list(limit=recent, statuses=(JobStatus.SUCCEEDED,))[::-1]:
        if job.started_at and job.finished_at:
            found.recent.append(job.finished_at - job.started_at)
    if not owns_folder:
        return found
    for partial in files.results_dir.glob(".*.mp4.partial-*"):
        partial.unlink(missing_ok=True)
    waiting = set(found.queued) | {job.id for job in store.list(statuses=(JobStatus.RUNNING,))}
    files.remove_stale_previews(waiting)
    for folder in files.uploads_dir.iterdir():
        if JOB_ID.match(folder.name) and folder.name not in waiting:
            shutil.rmtree(folder, ignore_errors=True)
    adopt_orphans(store, files)
    return found


def adopt_orphans(store: JobStore, files: JobFiles) -> list[str]:
    """Give every `<job id>.mp4` without a row a succeeded row with what the file tells; remove the ones that do not
    decode. Returns the ids adopted."""
    known = {job.id for job in store.list()}
    adopted = []
    for path in sorted(files.results_dir.glob("*.mp4"), key=lambda item: item.stat().st_mtime):
        job_id = path.stem
        if not JOB_ID.match(job_id) or job_id in known:
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
        store.insert(
            Job(
                id=job_id,
                status=JobStatus.SUCCEEDED,
                created_at=when,
                finished_at=when,
                request=request,
                progress=100.0,
                result_path=str(path),
                result_bytes=path.stat().st_size,
            )
        )
        adopted.append(job_id)
        logger.warning(
            "adopted %s: no job named it (the job database was lost or damaged); it is served as a "
            "succeeded job whose request is unknown",
            path.name,
        )
    return adopted
