"""The job store's two backends behind one interface (`h3gen.server.store`): every operation runs against SQLite and
against a throw-away PostgreSQL server (`helpers/postgres.py`), including workers racing to claim jobs from threads
of two store objects and from two processes. Then what is one backend's own: an old SQLite file gains the new
columns, `open_store` picks the backend, SQLite alone never imports psycopg, PostgreSQL connects again after losing
its connection and keeps passwords out of its messages."""

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from h3gen.server.job import Job, JobStatus
from h3gen.server.store import JobStore, SQLiteJobStore, StoreMismatch, open_store

HELPERS = Path(__file__).parent / "helpers"


def _job(job_id: str, status=JobStatus.QUEUED, **fields) -> Job:
    return Job(id=job_id, status=status, created_at=time.time(), request={"prompt": job_id}, **fields)


def _ids(jobs) -> list[str]:
    return [job.id for job in jobs]


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path):
    """Where a store lives: a folder (SQLite) or a database URL of its own (PostgreSQL)."""
    if request.param == "sqlite":
        return tmp_path / "store"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def opener(location):
    """`opener(fleet=None)` opens one more store object on `location`; all are closed after the test."""
    opened = []

    def open_one(fleet=None) -> JobStore:
        store = open_store(location, fleet)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


@pytest.fixture
def store(opener) -> JobStore:
    return opener()


# ---------------------------------------------------------------------- the jobs


def test_a_job_round_trips_every_field_and_updates_in_place(store):
    job = _job(
        "a" * 32,
        uploads={"image": "/u/a.png"},
        progress=12.5,
        stage="denoise",
        timings={"encode": 0.25},
        error=None,
        started_at=1.5,
        result_bytes=2**40,  # past 32 bits
        attempts=1,
        worker_id="w1",
        lease_expires=99.0,
        cancel_requested=True,
        needs={"task": "t2va", "quality": "lossless", "seconds": 5.0, "loras": ["style"]},
    )
    job.request = {"prompt": "z", "b": 1, "a": [1.5, None]}  # key order is kept
    store.insert(job)
    got = store.get(job.id)
    assert got == job and list(got.request) == ["prompt", "b", "a"]
    assert isinstance(got.progress, float) and got.cancel_requested is True and got.status is JobStatus.QUEUED
    store.update(job.id, status=JobStatus.SUCCEEDED, progress=100.0, result_path="/r/a.mp4", cancel_requested=False)
    got = store.get(job.id)
    assert (got.status, got.progress, got.result_path, got.cancel_requested) == ("succeeded", 100.0, "/r/a.mp4", False)
    assert got.needs == job.needs and got.timings == {"encode": 0.25}
    store.update(job.id)  # nothing to set: nothing happens
    with pytest.raises(TypeError, match="no field colour"):
        store.update(job.id, colour="red")
    assert store.get("nothing") is None
    store.delete(job.id)
    assert store.get(job.id) is None
    store.delete(job.id)  # deleting what is gone is no error


def test_list_pages_in_submission_order_and_filters_by_status(store):
    for index in range(6):
        store.insert(_job(f"j{index}", JobStatus.SUCCEEDED if index % 2 else JobStatus.QUEUED))
    assert _ids(store.list()) == ["j5", "j4", "j3", "j2", "j1", "j0"]
    assert _ids(store.list(newest_first=False, limit=2)) == ["j0", "j1"]
    assert _ids(store.list(newest_first=False, after="j1", limit=2)) == ["j2", "j3"]
    assert _ids(store.list(after="j4")) == ["j3", "j2", "j1", "j0"]
    assert _ids(store.list(statuses=(JobStatus.QUEUED,))) == ["j4", "j2", "j0"]
    assert _ids(store.list(limit=0)) == [] and store.list(after="nothing") == []
    assert store.count_by_status() == {"queued": 3, "succeeded": 3}


# ---------------------------------------------------------------------- the fleet's workers take jobs


def test_claim_takes_the_oldest_job_the_worker_can_serve(store):
    store.insert(_job("i2va", needs={"task": "i2va"}))
    store.insert(_job("t2va", needs={"task": "t2va", "loras": ["style"]}))
    store.insert(_job("later", needs={"task": "t2va"}))
    seen = []

    def text_only(needs):
        seen.append(needs)
        return needs.get("task") == "t2va"

    before = time.time()
    job = store.claim("w1", text_only, lease_seconds=30)
    assert job.id == "t2va" and seen[:2] == [{"task": "i2va"}, {"task": "t2va", "loras": ["style"]}]
    assert (job.status, job.worker_id, job.attempts, job.cancel_requested) == ("running", "w1", 1, False)
    assert before - 1 <= job.started_at <= time.time() + 1 and job.lease_expires == pytest.approx(job.started_at + 30)
    assert store.get("t2va") == job
    assert store.claim("w2", text_only, 30).id == "later"
    assert store.claim("w3", text_only, 30) is None  # only the image job is left
    assert store.claim("w3", lambda needs: True, 30).id == "i2va"
    assert store.claim("w3", lambda needs: True, 30) is None


def test_a_failing_can_serve_claims_nothing(store):
    store.insert(_job("a"))

    def broken(needs):
        raise ValueError("no")

    with pytest.raises(ValueError):
        store.claim("w1", broken, 30)
    assert store.get("a").status == JobStatus.QUEUED and store.claim("w1", lambda needs: True, 30).id == "a"


def test_claim_reads_past_a_batch_of_jobs_the_worker_cannot_serve(store):
    for index in range(70):  # more than two of claim's batches
        store.insert(_job(f"j{index:02d}", needs={"gpu": index == 69}))
    assert store.claim("w1", lambda needs: needs["gpu"], 30).id == "j69"


def test_heartbeat_renews_the_workers_leases_and_reports_cancellations(store):
    for name in ("a", "b", "c"):
        store.insert(_job(name))
    a = store.claim("w1", lambda needs: True, 5)
    store.claim("w1", lambda needs: True, 5)
    c = store.claim("w2", lambda needs: True, 5)
    assert store.heartbeat("w1", 100) == []
    assert store.get("a").lease_expires > a.lease_expires + 90 and store.get("b").lease_expires > a.lease_expires + 90
    assert store.get("c").lease_expires == c.lease_expires  # another worker's
    assert store.request_cancel("b") == JobStatus.RUNNING
    assert store.heartbeat("w1", 100) == ["b"] and store.heartbeat("w2", 100) == []
    assert store.heartbeat("nobody", 100) == []


def test_finish_writes_only_while_the_worker_holds_the_job(store):
    store.insert(_job("a"))
    store.claim("w1", lambda needs: True, 5)
    assert store.requeue_expired(now=time.time() + 60) == [("a", JobStatus.QUEUED)]
    taken = store.claim("w2", lambda needs: True, 30)
    assert (taken.id, taken.attempts, taken.worker_id) == ("a", 2, "w2")
    assert not store.finish("a", "w1", status=JobStatus.FAILED, error="stale")  # w1 lost it
    assert store.get("a").status == JobStatus.RUNNING and store.get("a").error is None
    assert not store.update_held("a", "w1", progress=55.0, stage="decode")  # nor may it report progress
    assert store.update_held("a", "w2", progress=12.5, stage="denoise")
    assert (store.get("a").progress, store.get("a").stage) == (12.5, "denoise")
    finished_at = time.time()
    assert store.finish("a", "w2", status=JobStatus.SUCCEEDED, progress=100.0, finished_at=finished_at, stage=None)
    job = store.get("a")
    assert (job.status, job.progress, job.finished_at, job.lease_expires, job.worker_id) == (
        "succeeded",
        100.0,
        finished_at,
        None,
        "w2",
    )
    assert not store.finish("a", "w2", status=JobStatus.FAILED)  # finished already
    assert not store.finish("nothing", "w2", status=JobStatus.FAILED)
    with pytest.raises(TypeError):
        store.finish("a", "w2", colour="red")


def test_requeue_expired_keeps_the_place_then_gives_up(store):
    for name in ("first", "second", "cancelled", "fresh"):
        store.insert(_job(name))
    for _ in range(3):
        store.claim("w1", lambda needs: True, 5)
    store.claim("w2", lambda needs: True, 600)  # "fresh": its lease runs long
    store.request_cancel("cancelled")
    store.update("first", progress=40.0, stage="denoise", timings={"denoise": 3.0})
    later = time.time() + 60
    assert store.requeue_expired(now=later) == [
        ("first", JobStatus.QUEUED),
        ("second", JobStatus.QUEUED),
        ("cancelled", JobStatus.CANCELLED),
    ]
    first = store.get("first")
    assert (first.status, first.progress, first.stage, first.timings, first.worker_id, first.lease_expires) == (
        "queued",
        0.0,
        None,
        {},
        None,
        None,
    )
    assert store.get("cancelled").finished_at == later and store.get("fresh").status == JobStatus.RUNNING
    assert _ids(store.list(newest_first=False)) == ["first", "second", "cancelled", "fresh"]  # same place
    assert store.claim("w3", lambda needs: True, 5).id == "first"  # first in line again
    assert store.requeue_expired(now=time.time()) == []  # its new lease has not run out
    assert store.requeue_expired(now=time.time() + 60, max_attempts=2) == [("first", JobStatus.FAILED)]
    failed = store.get("first")
    assert failed.attempts == 2 and failed.finished_at is not None and failed.worker_id == "w3"
    assert failed.error.startswith("the job's worker was lost 2 times (the last, w3, stopped renewing its lease")
    assert "not retried" in failed.error
    store.claim("w4", lambda needs: True, 5)  # "second", attempt 2
    assert store.requeue_expired(now=time.time() + 60, max_attempts=3) == [("second", JobStatus.QUEUED)]


def test_a_job_taken_back_keeps_no_preview(store):
    made = {"made_at": time.time(), "forward": 5, "forwards": 49, "window": None, "seconds": 0.1}
    lost = ("lost", "cancelled", "lost_twice")
    stopping = ("stopping", "stopping_cancelled")
    for name in (*lost, *stopping):
        store.insert(_job(name, attempts=1 if name == "lost_twice" else 0))
    for _ in lost:
        store.claim("w1", lambda needs: True, 5)
    for _ in stopping:
        store.claim("w2", lambda needs: True, 600)
    for name in (*lost, *stopping):
        store.update(name, preview=made, eta_seconds=12.0)
    store.request_cancel("cancelled")
    store.request_cancel("stopping_cancelled")
    assert store.requeue_expired(now=time.time() + 60) == [
        ("lost", JobStatus.QUEUED),
        ("cancelled", JobStatus.CANCELLED),
        ("lost_twice", JobStatus.FAILED),
    ]
    assert store.hand_back("stopping", "w2") and store.hand_back("stopping_cancelled", "w2")
    taken = {name: store.get(name) for name in (*lost, *stopping)}
    assert {name: job.status for name, job in taken.items()} == {
        "lost": "queued",
        "cancelled": "cancelled",
        "lost_twice": "failed",
        "stopping": "queued",
        "stopping_cancelled": "cancelled",
    }
    assert all((job.preview, job.eta_seconds) == (None, None) for job in taken.values()), taken


def test_request_cancel_stops_a_queued_job_and_flags_a_running_one(store):
    for name in ("running", "queued", "done"):
        store.insert(_job(name))
    store.update("done", status=JobStatus.SUCCEEDED)
    assert store.claim("w1", lambda needs: True, 30).id == "running"
    assert store.request_cancel("queued") == JobStatus.CANCELLED
    queued = store.get("queued")
    assert queued.finished_at is not None and not queued.cancel_requested
    assert store.request_cancel("running") == JobStatus.RUNNING and store.get("running").cancel_requested
    assert store.request_cancel("done") == JobStatus.SUCCEEDED and not store.get("done").cancel_requested
    assert store.request_cancel("nothing") is None
    assert store.claim("w2", lambda needs: True, 30) is None  # a cancelled job is never claimed


def test_a_stopping_worker_hands_its_job_back_uncounted(store):
    for name in ("a", "b", "c"):
        store.insert(_job(name))
    store.claim("w1", lambda needs: True, 30)
    store.update("a", progress=50.0, stage="denoise", timings={"denoise": 2.0})
    assert not store.hand_back("a", "w2")  # not its job
    assert store.hand_back("a", "w1")
    a = store.get("a")
    assert (a.status, a.attempts, a.worker_id, a.lease_expires, a.progress, a.stage, a.timings) == (
        "queued",
        0,
        None,
        None,
        0.0,
        None,
        {},
    )
    assert not store.hand_back("a", "w1")  # no longer held
    assert store.claim("w2", lambda needs: True, 30).id == "a"  # first in line again
    store.claim("w2", lambda needs: True, 30)
    assert not store.cancel_requested("b")
    store.request_cancel("b")
    assert store.cancel_requested("b") and not store.cancel_requested("c") and not store.cancel_requested("nothing")
    assert store.hand_back("b", "w2") and store.get("b").status == JobStatus.CANCELLED  # not queued again


def test_workers_register_are_seen_and_leave(store):
    store.register_worker("w1", {"tasks": ["t2va"], "gpus": 8}, "gpu-1")
    store.register_worker("w2", {"tasks": ["i2va"]}, "gpu-2")
    store.insert(_job("a"))
    store.claim("w1", lambda needs: True, 30)
    workers = store.live_workers(within_seconds=60)
    assert [w["id"] for w in workers] == ["w1", "w2"]
    assert workers[0]["host"] == "gpu-1" and workers[0]["capabilities"] == {"tasks": ["t2va"], "gpus": 8}
    assert workers[0]["running_job"] == "a" and workers[1]["running_job"] is None
    time.sleep(0.3)
    store.heartbeat("w1", 30)
    assert [w["id"] for w in store.live_workers(within_seconds=0.2)] == ["w1"]
    store.worker_seen("w2")
    assert [w["id"] for w in store.live_workers(within_seconds=0.2)] == ["w1", "w2"]
    store.register_worker("w2", {"tasks": ["t2va"]}, "gpu-3")  # registering again replaces
    again = store.live_workers(60)[1]
    assert again["host"] == "gpu-3" and again["capabilities"] == {"tasks": ["t2va"]}
    store.unregister_worker("w1")
    assert [w["id"] for w in store.live_workers(60)] == ["w2"]
    assert store.get("a").status == JobStatus.RUNNING  # its job waits for its lease to run out


def test_a_store_belongs_to_one_fleet(opener, location):
    unnamed = opener()
    assert unnamed.fleet is None
    assert opener(fleet="east").fleet == "east"  # an unnamed store takes the first fleet's name
    assert opener(fleet="east").fleet == "east" and opener().fleet == "east"
    with pytest.raises(StoreMismatch, match="belongs to the fleet 'east', not 'west'"):
        opener(fleet="west")
    assert "password" not in str(location)


# ---------------------------------------------------------------------- races


def test_threads_of_two_store_objects_never_claim_one_job_twice(opener):
    stores = [opener(), opener()]
    for index in range(50):
        stores[index % 2].insert(_job(f"j{index:02d}"))
    claimed: dict[str, list[str]] = {}
    start = threading.Barrier(8)

    def work(store, worker):
        start.wait()
        mine = claimed.setdefault(worker, [])
        while (job := store.claim(worker, lambda needs: time.sleep(0.001) or True, 30)) is not None:
            mine.append(job.id)

    threads = [threading.Thread(target=work, args=(stores[n % 2], f"w{n}")) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    every = [job_id for ids in claimed.values() for job_id in ids]
    assert sorted(every) == [f"j{index:02d}" for index in range(50)]  # each once, none left
    for worker, ids in claimed.items():
        assert all(stores[0].get(job_id).worker_id == worker for job_id in ids)
        assert ids == sorted(ids)  # a worker's claims come in submission order
    assert stores[1].count_by_status() == {"running": 50}


def test_two_processes_never_claim_one_job_twice(store, location):
    for index in range(50):
        store.insert(_job(f"j{index:02d}"))
    workers = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "claim_race.py"), str(location), f"w{n}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        for worker in workers:
            assert worker.stdout.readline().strip() == "ready"
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        claimed = [json.loads(worker.communicate(timeout=60)[0]) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert all(worker.returncode == 0 for worker in workers)
    assert sorted(claimed[0] + claimed[1]) == [f"j{index:02d}" for index in range(50)]
    assert {store.get(job_id).worker_id for job_id in claimed[0]} <= {"w0"}
    assert {store.get(job_id).worker_id for job_id in claimed[1]} <= {"w1"}


def test_inserts_from_two_store_objects_share_one_order(opener):
    stores = [opener(), opener()]

    def submit(store, prefix):
        for index in range(20):
            store.insert(_job(f"{prefix}{index:02d}"))

    threads = [
        threading.Thread(target=submit, args=(store, prefix)) for store, prefix in zip(stores, "ab", strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    order = _ids(stores[0].list(newest_first=False))
    assert len(order) == 40 and order == _ids(stores[1].list(newest_first=False))
    for prefix in "ab":
        mine = [job_id for job_id in order if job_id.startswith(prefix)]
        assert mine == sorted(mine)  # each store's jobs in the order it submitted them
    assert _ids(stores[0].list(after=order[19], newest_first=False)) == order[20:]


def test_a_full_queue_takes_no_more_jobs_from_racing_submitters(opener):
    """Submitters on three store objects (three API nodes) race for the last places of a queue of five: five get
    in, never six, whatever the interleaving."""
    stores = [opener(), opener(), opener()]
    start = threading.Barrier(6)
    added = []

    def submit(store, prefix):
        start.wait(30)
        for index in range(10):
            if store.insert(_job(f"{prefix}{index}"), max_queued=5):
                added.append(f"{prefix}{index}")

    threads = [threading.Thread(target=submit, args=(stores[i % 3], f"t{i}-")) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(added) == 5 and sorted(_ids(stores[0].list())) == sorted(added)
    stores[1].update(added[0], status=JobStatus.RUNNING)  # a place frees when a worker takes a job
    assert stores[2].insert(_job("late"), max_queued=5) and not stores[0].insert(_job("later"), max_queued=5)
    assert stores[0].insert(_job("no limit"))


# ---------------------------------------------------------------------- each backend's own


OLD_SCHEMA = (
    "CREATE TABLE jobs (id TEXT PRIMARY KEY, status TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL, "
    "finished_at REAL, request TEXT NOT NULL, progress REAL NOT NULL DEFAULT 0, stage TEXT, timings TEXT NOT NULL "
    "DEFAULT '{}', error TEXT, result_path TEXT, result_bytes INTEGER, uploads TEXT NOT NULL DEFAULT '{}', seq INTEGER)"
)


def test_a_sqlite_file_of_the_previous_layout_gains_the_new_columns(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    db = sqlite3.connect(path)
    db.execute(OLD_SCHEMA)
    db.execute("CREATE INDEX jobs_status ON jobs(status)")
    db.execute(
        "INSERT INTO jobs (id, status, created_at, request, progress, timings, uploads, seq) "
        "VALUES ('old', 'succeeded', 1.0, '{\"prompt\": \"kept\"}', 100.0, '{\"denoise\": 2.0}', '{}', 1)"
    )
    db.commit()
    db.close()
    store = open_store(tmp_path, fleet="east")
    try:
        old = store.get("old")
        assert old.request == {"prompt": "kept"} and old.timings == {"denoise": 2.0} and old.progress == 100.0
        assert (old.attempts, old.worker_id, old.lease_expires, old.cancel_requested, old.needs) == (
            0,
            None,
            None,
            False,
            {},
        )
        store.insert(_job("new", needs={"task": "t2va"}))
        assert _ids(store.list()) == ["new", "old"] and store.claim("w", lambda needs: True, 30).id == "new"
        assert store.moved_aside is None and store.fleet == "east"
    finally:
        store.close()
    again = SQLiteJobStore(path)
    try:
        assert again.fleet == "east" and again.get("new").needs == {"task": "t2va"}
    finally:
        again.close()


def test_a_store_of_a_newer_layout_is_refused(tmp_path):
    open_store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("UPDATE store_meta SET schema_version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreMismatch, match="has layout 99, newer than this h3gen's"):
        open_store(tmp_path)


def test_open_store_picks_the_backend_from_the_location(tmp_path):
    folder = open_store(tmp_path / "results")
    named = open_store(tmp_path / "elsewhere" / "queue.db")
    try:
        assert isinstance(folder, SQLiteJobStore) and folder.path == tmp_path / "results" / "jobs.sqlite3"
        assert named.path == tmp_path / "elsewhere" / "queue.db"
    finally:
        folder.close()
        named.close()
    with pytest.raises(ValueError, match="postgresql://"):
        open_store("mysql://db/jobs")


def test_the_sqlite_store_never_imports_psycopg(tmp_path):
    code = (
        "import sys; from h3gen.server.store import open_store; store = open_store(sys.argv[1]); store.close(); "
        "import h3gen.server.jobs; print(sorted(name for name in sys.modules if name.startswith('psycopg')))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_postgres_url_forms_passwords_and_a_closed_store(postgres_url):
    from h3gen.server.store_postgres import PostgresJobStore, redact

    assert redact("postgresql://me:s3cret@db:5432/h3gen") == "postgresql://me:***@db:5432/h3gen"
    assert redact("postgresql://me@db/h3gen?password=s3cret&sslmode=require") == (
        "postgresql://me@db/h3gen?password=***&sslmode=require"
    )
    short = open_store(postgres_url.replace("postgresql://", "postgres://", 1))
    assert isinstance(short, PostgresJobStore)
    short.insert(_job("a"))
    short.close()
    short.close()  # idempotent
    with pytest.raises(Exception, match="is closed"):
        short.get("a")
    store = open_store(postgres_url)
    try:
        assert store.get("a").request == {"prompt": "a"}
    finally:
        store.close()


def test_postgres_connects_again_after_losing_its_connection(postgres_url):
    import psycopg

    store = open_store(postgres_url)
    try:
        store.insert(_job("a"))
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'h3gen' "
                "AND datname = current_database()"
            )
        with pytest.raises(psycopg.OperationalError):
            store.get("a")  # the call that finds the connection gone fails
        assert store.get("a").id == "a"  # the next connects again
    finally:
        store.close()
