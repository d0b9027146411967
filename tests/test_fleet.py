"""A fleet: API nodes and `h3gen worker` processes on one job store, PostgreSQL (two API nodes, three workers) and
SQLite (one box: one API node, three workers), with the tiny model on the CPU. Jobs submitted to either node all
finish, none twice; a worker killed mid-job loses its lease and another finishes the job; a cancellation on one node
stops a job another node took; an API node restarted mid-run loses nothing; a job no live worker can serve is refused
when submitted."""

import signal
import time

import pytest
from helpers.server_harness import Server, Worker, cancelled, live_workers, wait_for

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.slow]

FAST = {"seconds": 5, "num_inference_steps": 2, "aspect_ratio": "2:1"}
LONG = {"seconds": 5, "num_inference_steps": 400, "aspect_ratio": "2:1"}
MEDIUM = {"seconds": 5, "num_inference_steps": 150, "aspect_ratio": "2:1"}
LEASE = ("--lease-seconds", "3")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("fleet-cache"))


def _wait_workers(http, count: int, timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = live_workers(http)
        if len(live) >= count:
            return live
        time.sleep(0.2)
    raise AssertionError(f"{count} workers did not register: {live_workers(http)}")


def _fleet_round(nodes, workers, store_rows):
    """30 jobs over the API nodes in turn; every one completes once; the worker that ran each is recorded."""
    ids = []
    for index in range(30):
        with nodes[index % len(nodes)].client() as http:
            response = http.post("/v1/videos", json={"prompt": f"job {index}", **FAST})
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
    with nodes[-1].client() as http:
        for job_id in ids:
            assert wait_for(http, job_id, timeout=300)["status"] == "completed"
    ran = store_rows(ids)
    assert all(job.attempts == 1 for job in ran), [(job.id, job.attempts) for job in ran]  # none run twice
    assert len({job.worker_id for job in ran}) >= 2  # the work was shared


def _kill_a_worker_mid_job(node, workers, reader):
    """kill -9 of the worker running a job: its lease ends, the job is re-queued and another worker completes it."""
    with node.client() as http:
        job_id = http.post("/v1/videos", json={"prompt": "outlives its worker", **MEDIUM}).json()["id"]
        wait_for(http, job_id, statuses=("in_progress",), predicate=lambda v: v["progress"] > 1)
        holder = reader.get(job_id).worker_id
        victim = next(w for w in workers if w.name == holder)
        victim.kill()  # no shutdown code runs: the lease just stops being renewed
        workers.remove(victim)
        assert wait_for(http, job_id, timeout=180)["status"] == "completed"
    job = reader.get(job_id)
    assert job.worker_id != holder and job.attempts == 2


def _cancel_from_the_other_node(first, second):
    with first.client() as http:
        job_id = http.post("/v1/videos", json={"prompt": "to cancel", **LONG}).json()["id"]
        wait_for(http, job_id, statuses=("in_progress",), predicate=lambda v: v["progress"] > 1)
    with second.client() as other:
        started = time.monotonic()
        assert other.delete(f"/v1/videos/{job_id}").status_code == 200
        assert time.monotonic() - started < 2.0
    with first.client() as http:
        assert cancelled(wait_for(http, job_id, statuses=("failed",), timeout=10))


def _refuses_what_no_worker_serves(node):
    with node.client() as http:
        response = http.post(
            "/v1/videos",
            data={"prompt": "a voice", "task": "ref2va"},
            files={"ref_image": ("a.png", _png(), "image/png")},
        )
        assert response.status_code == 422, response.text
        assert "no worker" in response.text or "does not serve task ref2va" in response.text


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_postgresql_fleet_of_two_api_nodes_and_three_workers(model, tmp_path, postgres_url):
    from h3gen.server.store import open_store

    results = tmp_path / "results"
    results.mkdir()
    store = ("--store", postgres_url)
    workers = [Worker(model, postgres_url, results, f"w{i}", extra=(*LEASE, "--workflow", "t2va")) for i in range(3)]
    nodes = [
        Server(model, results, max_queue=40, extra=(*store, "--workers", "0", *LEASE, "--workflow", "all"))
        for _ in range(2)
    ]
    reader = open_store(postgres_url)
    try:
        with nodes[0].client() as http:
            _wait_workers(http, 3)
        _fleet_round(nodes, workers, lambda ids: [reader.get(job_id) for job_id in ids])
        _cancel_from_the_other_node(nodes[0], nodes[1])
        _refuses_what_no_worker_serves(nodes[1])
        # An API node restarted while a job runs: the job goes on and the other node and the new one answer for it.
        with nodes[0].client() as http:
            job_id = http.post("/v1/videos", json={"prompt": "across a restart", **FAST}).json()["id"]
        nodes[0].kill()
        nodes[0] = Server(model, results, max_queue=40, extra=(*store, "--workers", "0", *LEASE, "--workflow", "all"))
        with nodes[0].client() as http:
            assert wait_for(http, job_id, timeout=120)["status"] == "completed"
        _kill_a_worker_mid_job(nodes[1], workers, reader)
    finally:
        reader.close()
        for node in nodes:
            node.stop()
        for worker in workers:
            worker.stop()


def test_one_box_serves_with_three_local_workers_on_sqlite(model, tmp_path):
    from h3gen.server.store import open_store

    results = tmp_path / "results"
    node = Server(model, results, max_queue=40, extra=("--workers", "3", *LEASE, "--workflow", "t2va"))
    try:
        with node.client() as http:
            _wait_workers(http, 3)
        reader = open_store(results)
        try:
            _fleet_round([node], [], lambda ids: [reader.get(job_id) for job_id in ids])
        finally:
            reader.close()
        _refuses_what_no_worker_serves(node)
    finally:
        node.stop()


def test_gpu_groups_as_workers_hand_back_and_drain(model, tmp_path):
    """A TP x Ulysses group is one worker: `serve --workers 2 --ulysses 2` runs two groups of two ranks (gloo on the
    CPU) that share the jobs, and its stop hands a running job back to the queue uncounted; an `h3gen worker --tp 2`
    then takes that job, and SIGTERM drains it: the job finishes there and the group exits cleanly."""
    from h3gen.server.store import open_store

    results = tmp_path / "results"
    node = Server(model, results, max_queue=40, extra=("--workers", "2", "--ulysses", "2", *LEASE), ready_timeout=180)
    reader = open_store(results)
    group = None
    try:
        with node.client() as http:
            live = _wait_workers(http, 2, timeout=240)
            assert all("ulysses 2" in " ".join(worker["capabilities"]["devices"]) for worker in live)
            ids = [http.post("/v1/videos", json={"prompt": f"job {i}", **FAST}).json()["id"] for i in range(6)]
            for job_id in ids:
                assert wait_for(http, job_id, timeout=300)["status"] == "completed"
            ran = [reader.get(job_id) for job_id in ids]
            assert all(job.attempts == 1 for job in ran) and len({job.worker_id for job in ran}) == 2
            job_id = http.post("/v1/videos", json={"prompt": "outlives its server", **LONG}).json()["id"]
            wait_for(http, job_id, statuses=("in_progress",), predicate=lambda v: v["progress"] > 1)
        node.stop()
        job = reader.get(job_id)
        assert (job.status, job.attempts, job.worker_id) == ("queued", 0, None)

        group = Worker(model, str(results), results, "tp-group", extra=("--tp", "2", *LEASE, "--drain-seconds", "300"))
        node = Server(model, results, max_queue=40, extra=("--workers", "0", *LEASE), ready_timeout=240)
        with node.client() as http:
            wait_for(http, job_id, statuses=("in_progress",), timeout=240, predicate=lambda v: v["progress"] > 1)
            assert reader.get(job_id).worker_id == "tp-group"
            group.process.send_signal(signal.SIGTERM)  # to the group's front process: a drain
            assert wait_for(http, job_id, timeout=300)["status"] == "completed"
        assert group.process.wait(60) == 0 and reader.get(job_id).attempts == 1
    finally:
        reader.close()
        node.stop()
        if group is not None:
            group.stop()
