"""The job manager's ownership of its results folder: the folder lock, the database's life (checkpoint and close on
shutdown, a damaged file moved aside), orphan MP4s, the retention timer, cancel of a job this process is not running,
the state `cancel` answers with, and the Retry-After estimate. In-process with a scripted engine, and through two
real servers where the process boundary is the point."""

import logging
import signal
import sqlite3
import threading
import time

import numpy as np
import pytest
from helpers.server_harness import Server, cancelled, done_running_queued, wait_for

from h3gen.media import write_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.job import Job, JobStatus
from h3gen.server.job_files import JobFiles
from h3gen.server.job_worker import JobWorker
from h3gen.server.jobs import JobManager, default_job_seconds
from h3gen.server.lock import FolderBusy
from h3gen.server.store import SQLiteJobStore, open_store

# Real servers and job managers running jobs: outside the fast tier.
pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 3}
LONG = {"num_inference_steps": 1000}


class ScriptedEngine:
    """Runs each job as `steps` denoising reports `pause` seconds apart, then writes a placeholder file."""

    load_error = None
    model_path = None
    ready = True

    def __init__(self, steps: int = 200, pause: float = 0.01):
        self.steps, self.pause = steps, pause

    def load(self) -> None:
        pass

    def devices(self) -> list[str]:
        return ["cpu"]

    def run(self, request, images, out_path, callback) -> None:
        callback("denoise", 0, self.steps)
        for step in range(1, self.steps + 1):
            time.sleep(self.pause)
            callback("denoise", step, self.steps)
        out_path.write_bytes(b"mp4")


def _until(condition, seconds: float) -> None:
    """Poll `condition` every 10 ms until it holds or `seconds` pass (the assertions after it say which)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def _job(manager, **request):
    return manager.submit({"prompt": "x", **request})


@pytest.fixture
def results(tmp_path):
    return tmp_path / "results"


def test_a_second_manager_on_one_folder_is_refused_naming_the_holder(results):
    first = JobManager(ScriptedEngine(), results, owner="h3gen serve on http://127.0.0.1:1234")
    try:
        with pytest.raises(FolderBusy) as info:
            JobManager(ScriptedEngine(), results)
        assert "127.0.0.1:1234" in str(info.value) and "pid" in str(info.value)
    finally:
        first.stop()
    JobManager(ScriptedEngine(), results).stop()  # released by stop()


def test_cancel_of_a_running_row_this_process_does_not_run_is_answered(results):
    manager = JobManager(ScriptedEngine(), results)
    try:
        manager.store.insert(
            Job(id="a" * 32, status=JobStatus.RUNNING, created_at=time.time(), request={}, progress=40.0)
        )
        view = manager.cancel("a" * 32)
        assert view["status"] == "cancelled" and manager.get("a" * 32)["status"] == "cancelled"
    finally:
        manager.stop()


def test_cancel_answers_with_the_state_after_the_engine_stopped(results):
    manager = JobManager(ScriptedEngine(steps=10_000), results)
    manager.start()
    try:
        job = _job(manager)
        _until(lambda: (manager.get(job["id"])["progress"] or 0) >= 5, 30)
        view = manager.cancel(job["id"])
        assert view["status"] == "cancelled" and view["stage"] is None and view["finished_at"]
        assert manager.worker.running is None  # the worker acknowledged before the answer
        assert view["progress"] > 5 and "denoise" in view["timings"]
        assert manager.get(job["id"]) == view
    finally:
        manager.stop()


def test_stop_hands_the_running_job_back_to_the_queue_and_closes_the_store(results):
    manager = JobManager(ScriptedEngine(steps=10_000), results)
    manager.start()
    job = _job(manager)
    queued = _job(manager)
    _until(lambda: manager.get(job["id"])["status"] == "running", 30)
    manager.stop()
    with pytest.raises(sqlite3.ProgrammingError):
        manager.store.get(job["id"])
    store = SQLiteJobStore(results / "jobs.sqlite3")
    handed_back = store.get(job["id"])  # the next start (or another worker) runs it; this attempt is not counted
    assert handed_back.status == JobStatus.QUEUED and handed_back.attempts == 0 and handed_back.progress == 0
    assert store.get(queued["id"]).status == JobStatus.QUEUED  # kept for the next start
    store.close()
    wal = results / "jobs.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # everything is in the database file


def test_a_damaged_database_is_moved_aside_and_the_server_starts_fresh(results, caplog):
    results.mkdir(parents=True)
    (results / "jobs.sqlite3").write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.ERROR, logger="h3gen.server.store"):
        manager = JobManager(ScriptedEngine(steps=2), results)
    try:
        aside = manager.store.moved_aside
        assert aside is not None and aside.name.startswith("jobs.sqlite3.corrupt-")
        assert aside.read_bytes() == b"this is not a database" * 100
        assert any("DAMAGED" in record.getMessage() for record in caplog.records)
        manager.start()
        job = _job(manager)
        assert manager.wait(job["id"], 30)["status"] == "succeeded"
    finally:
        manager.stop()


def test_orphan_mp4s_are_adopted_or_removed(results):
    results.mkdir(parents=True)
    orphan, broken = results / ("b" * 32 + ".mp4"), results / ("c" * 32 + ".mp4")
    frames = np.zeros((12, 32, 48, 3), np.float32)
    write_mp4(orphan, frames, np.zeros((2, 16000), np.float32), fps=24)
    broken.write_bytes(b"half an mp4")
    foreign = results / "mine.mp4"
    foreign.write_bytes(b"not the server's")
    manager = JobManager(ScriptedEngine(), results)
    manager.start()
    try:
        view = manager.get("b" * 32)
        assert view["status"] == "succeeded" and view["content_url"]
        assert view["request"]["adopted"] is True and view["request"]["width"] == 48
        assert view["request"]["num_frames"] == 12 and manager.result_path("b" * 32) == orphan
        assert not broken.exists() and manager.get("c" * 32) is None
        assert foreign.exists()  # not named like a job: not the server's to judge
    finally:
        manager.stop()


def test_retention_runs_on_a_timer_on_an_idle_server(results):
    manager = JobManager(ScriptedEngine(steps=2), results, retention_seconds=0.5, sweep_seconds=0.2)
    manager.start()
    try:
        job = _job(manager)
        assert manager.wait(job["id"], 30)["status"] == "succeeded"
        assert (results / f"{job['id']}.mp4").exists()
        _until(lambda: manager.get(job["id"]) is None, 5)
        assert manager.get(job["id"]) is None and not (results / f"{job['id']}.mp4").exists()
    finally:
        manager.stop()
    assert not any(thread.name == "h3gen-retention" and thread.is_alive() for thread in threading.enumerate())


def test_retry_after_is_estimated_from_measured_job_times(results):
    model = tiny_checkpoint()
    manager = JobManager(ScriptedEngine(), results)
    try:
        manager.engine.model_path = model
        first_guess = default_job_seconds(model)
        assert 10 <= first_guess < 11  # the tiny model: a few MB of transformer weights
        assert manager.retry_after() == 11  # no job measured yet, none running: one whole job
        manager._recent.extend([8.0, 10.0, 12.0])
        assert manager.retry_after() == 10
        running = Job(id="d" * 32, status=JobStatus.RUNNING, created_at=time.time(), request={})
        running.started_at = time.time() - 4.0
        manager.store.insert(running)
        assert manager.retry_after() == 6  # what is left of the running job
        manager.store.update("d" * 32, started_at=time.time() - 60.0)
        assert manager.retry_after() == 1  # overran: a tenth of a job
    finally:
        manager.stop()


def test_a_restart_after_a_history_seeds_the_estimate(results):
    manager = JobManager(ScriptedEngine(steps=20, pause=0.05), results)
    manager.start()
    job = _job(manager)
    assert manager.wait(job["id"], 30)["status"] == "succeeded"
    manager.stop()
    again = JobManager(ScriptedEngine(), results)
    again.recover()
    try:
        assert 1.0 <= again.mean_job_seconds() < 5.0
    finally:
        again.stop()


def test_a_lost_workers_job_goes_back_without_its_preview(results):
    """A fleet worker that dies mid-job leaves its preview in the shared folder: the worker that takes the job back
    removes it (and so does one that hands a job back), while the preview of a job whose worker is alive stays; a
    restart on one box, where every running job lost its worker, removes theirs."""
    results.mkdir(parents=True)
    store, files = open_store(results), JobFiles(results)
    lost, alive = "a" * 32, "b" * 32
    made = {"made_at": time.time(), "forward": 5, "forwards": 49, "window": None, "seconds": 0.1}
    for job_id, worker, lease in ((lost, "gone", -5.0), (alive, "elsewhere", 600.0)):
        store.insert(Job(id=job_id, status=JobStatus.QUEUED, created_at=time.time(), request={"prompt": "x"}))
        store.claim(worker, lambda needs: True, 600.0)
        store.update(job_id, lease_expires=time.time() + lease, preview=made, eta_seconds=9.0)
        files.write_preview(job_id, b"jpeg of attempt 1")
    worker = JobWorker(store, ScriptedEngine(steps=2000), files, worker_id="taker", lease_seconds=5)
    worker.start()
    try:
        _until(lambda: store.get(lost).worker_id == "taker", 30)
        job = store.get(lost)
        assert (job.status, job.worker_id, job.attempts, job.preview) == ("running", "taker", 2, None)
        assert not files.preview(lost).exists()
        assert files.preview(alive).read_bytes() == b"jpeg of attempt 1" and store.get(alive).preview == made
        files.write_preview(lost, b"jpeg of attempt 2")
    finally:
        worker.stop(drain=False)
    assert store.get(lost).status == JobStatus.QUEUED and not files.preview(lost).exists()  # handed back

    store.close()
    manager = JobManager(ScriptedEngine(), results)  # a restart on one box: every running job lost its worker
    try:
        manager.recover()
        job = manager.store.get(alive)
        assert (job.status, job.preview) == ("queued", None) and not files.preview(alive).exists()
    finally:
        manager.stop()


def test_a_worker_that_lost_its_job_leaves_the_new_attempts_row_and_files_alone(results):
    """A worker that stalled past its lease finds, at its next progress write, that the job went to another worker:
    it stops that attempt and writes nothing over the new one (row, preview, video)."""
    results.mkdir(parents=True)
    store, files = open_store(results), JobFiles(results)
    job_id = "e" * 32
    store.insert(Job(id=job_id, status=JobStatus.QUEUED, created_at=time.time(), request={"prompt": "x"}))
    worker = JobWorker(store, ScriptedEngine(steps=3000), files, worker_id="stalled", lease_seconds=60)
    worker.start()
    try:
        _until(lambda: store.get(job_id).stage == "denoise", 30)
        assert store.get(job_id).worker_id == "stalled"
        made = {"made_at": time.time(), "forward": 1, "forwards": 4, "window": None, "seconds": 0.1}
        store.update(job_id, worker_id="taker", attempts=2, preview=made, progress=3.0)  # as a take-over does
        files.write_preview(job_id, b"taker's preview")
        files.result(job_id).write_bytes(b"taker's video")
        _until(lambda: worker.running is None, 10)
        assert worker.running is None  # the lost attempt stopped long before its 3,000 steps
        job = store.get(job_id)
        assert (job.status, job.worker_id, job.preview, job.progress) == ("running", "taker", made, 3.0)
        assert files.preview(job_id).read_bytes() == b"taker's preview"
        assert files.result(job_id).read_bytes() == b"taker's video"
    finally:
        worker.stop(drain=False)
    assert store.get(job_id).worker_id == "taker" and files.preview(job_id).exists()


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


def test_a_second_server_on_one_folder_exits_naming_the_first(model, tmp_path):
    results = tmp_path / "results"
    first = Server(model, results)
    try:
        with first.client() as http:
            running = http.post("/v1/videos", json={"prompt": "first's job", **LONG}).json()["id"]
            wait_for(http, running, statuses=("in_progress",))
            with pytest.raises(RuntimeError) as info:
                Server(model, results)
            message = str(info.value)
            assert f"is in use by pid {first.process.pid}" in message and f":{first.port}" in message
            assert "Traceback" not in message
            view = http.get(f"/v1/videos/{running}").json()
            assert view["status"] == "in_progress"  # untouched by the second server
            assert cancelled(http.delete(f"/v1/videos/{running}").json()["video"])
            done = http.post("/v1/videos", json={"prompt": "after", **FAST}).json()["id"]
            assert wait_for(http, done)["status"] == "completed"
    finally:
        first.stop()


def test_sigterm_then_a_lost_wal_keeps_every_job(model, tmp_path):
    results = tmp_path / "results"
    first = Server(model, results)
    with first.client() as http:
        done, running, queued = done_running_queued(http, FAST, LONG)
    first.process.send_signal(signal.SIGTERM)
    first.process.wait(60)
    first.kill()
    for suffix in ("-wal", "-shm"):
        (results / f"jobs.sqlite3{suffix}").unlink(missing_ok=True)
    second = Server(model, results)
    try:
        with second.client() as http:
            assert http.get(f"/v1/videos/{done}").json()["status"] == "completed"
            assert http.get(f"/v1/videos/{done}/content").status_code == 200
            # The running job was handed back when the server stopped: the next start makes it again (it is long:
            # cancelled here once it is seen back in the queue or running, so the queued one gets its turn).
            view = http.get(f"/v1/videos/{running}").json()
            assert view["status"] in ("queued", "in_progress") and view["error"] is None
            assert http.delete(f"/v1/videos/{running}").status_code == 200
            assert wait_for(http, queued)["status"] == "completed"
    finally:
        second.stop()


class _FullDiskConnection:
    """A SQLite connection whose WAL checkpoint fails as on a full disk; everything else goes through."""

    def __init__(self, db):
        self.db = db

    def execute(self, sql, *args):
        if "wal_checkpoint" in sql:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def close(self):
        self.db.close()


def test_close_on_a_full_disk_says_what_it_kept_and_loses_nothing(tmp_path, caplog):
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    store.insert(
        Job(id="b" * 32, status=JobStatus.SUCCEEDED, created_at=time.time(), request={"prompt": "kept"}, progress=100.0)
    )
    store._db = _FullDiskConnection(store._db)
    with caplog.at_level(logging.ERROR, logger="h3gen.server.store"):
        store.close()  # no exception: shutdown goes on
    assert "jobs.sqlite3-wal" in caplog.text and "next start reads" in caplog.text
    again = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    assert again.get("b" * 32).request == {"prompt": "kept"}
    again.close()
