"""Retention: how long finished jobs and their videos are kept, and the timer that applies it on an idle server.

A sweep drops finished jobs older than the retention period, then the oldest results until the folder holds at most
the byte budget; upload staging folders older than `STALE_STAGING_SECONDS` go too. The manager sweeps after every job
and on a `SweepTimer`, so an idle server does not serve expired jobs.
"""

import logging
import shutil
import threading
import time
from collections.abc import Callable

from h3gen.server.job import FINISHED
from h3gen.server.job_files import JobFiles
from h3gen.server.store import JobStore

logger = logging.getLogger(__name__)

STALE_STAGING_SECONDS = 3600.0  # a request's upload folder older than this belongs to no request any more


def sweep(store: JobStore, files: JobFiles, *, retention_seconds: float, max_results_bytes: int) -> None:
    """Drop finished jobs older than `retention_seconds`, then the oldest results until the folder holds at most
    `max_results_bytes`, then stale upload staging folders."""
    now = time.time()
    kept = []
    for job in store.list(newest_first=False, statuses=FINISHED):
        if job.finished_at and now - job.finished_at > retention_seconds:
            files.remove(job, result=True, uploads=True)
            store.delete(job.id)
        else:
            kept.append(job)
    total = sum(job.result_bytes or 0 for job in kept)
    for job in kept:
        if total <= max_results_bytes:
            break
        if job.result_bytes:
            total -= job.result_bytes
            files.remove(job, result=True, uploads=True)
            store.delete(job.id)
    for folder in files.staging_dirs():
        try:
            if now - folder.stat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # its request removed it meanwhile
            pass


class SweepTimer:
    """Calls `sweep` every `period` seconds on a thread of its own until `stop()`; a failed sweep is logged and
    retried next period."""

    def __init__(self, sweep: Callable[[], None], period: float, name: str = "h3gen-retention"):
        self.sweep, self.period = sweep, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (see `join`)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sweep()
            except Exception:  # a failed sweep never stops the timer
                logger.exception("retention sweep failed")
