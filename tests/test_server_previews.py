"""Previews through the REST API, in-process on the tiny model: `GET /v1/videos/{id}/content?variant=preview` (a JPEG
from the shared results folder, 409 before the first and once the job is done), the job's `preview_at` / `preview`,
its time left (`eta_seconds`) and `preview_every: 0`."""

import io
import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.app import create_app
from h3gen.server.engine import H3Engine
from h3gen.server.jobs import JobManager


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    root = tmp_path_factory.mktemp("previews")
    manager = JobManager(H3Engine(tiny_checkpoint(cache_dir=root / "cache"), device="cpu"), root / "results")
    with TestClient(create_app(manager)) as client:
        client.manager = manager
        yield client


def _wait(http, job_id, predicate, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        view = http.get(f"/v1/videos/{job_id}").json()
        if predicate(view):
            return view
        time.sleep(0.02)
    raise AssertionError(f"waited {seconds} s; last view {view}")


def test_a_running_job_serves_its_latest_preview_then_its_video(http):
    job = http.post("/v1/videos", json={"prompt": "a fox", "num_inference_steps": 300, "preview_every": 25}).json()
    early = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "preview"})
    assert early.status_code == 409  # queued, or running before its first preview
    # The time left is written with the progress, at most every quarter second: the tiny model can make its first
    # preview before that.
    view = _wait(
        http, job["id"], lambda v: (v.get("preview_at") and v.get("eta_seconds")) or v["status"] == "completed"
    )
    assert view["status"] == "in_progress", view
    assert view["preview"]["forwards"] == 299 and view["preview"]["forward"] % 25 == 0
    assert view["preview"]["window"] is None and view["preview"]["url"].endswith("variant=preview")
    assert view["preview_at"] <= time.time() and view["eta_seconds"] is not None and view["eta_seconds"] > 0
    answer = http.get(view["preview"]["url"])
    assert answer.status_code == 200 and answer.headers["content-type"] == "image/jpeg"
    assert answer.headers["cache-control"] == "no-store"
    assert Image.open(io.BytesIO(answer.content)).size == (view["width"], view["height"])
    later = _wait(http, job["id"], lambda v: (v.get("preview") or {}).get("forward", 0) > view["preview"]["forward"])
    assert later["preview_at"] > view["preview_at"]  # replaced as new ones come
    done = _wait(http, job["id"], lambda v: v["status"] == "completed")
    assert done.get("preview_at") is None and done.get("eta_seconds") is None
    gone = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "preview"})
    assert gone.status_code == 409 and "variant=video" in gone.json()["error"]["message"]
    assert not http.manager.files.preview(job["id"]).exists()  # the video replaced it


def test_preview_every_zero_makes_none_and_bad_values_are_refused(http):
    job = http.post("/v1/videos", json={"prompt": "a fox", "num_inference_steps": 60, "preview_every": 0}).json()
    seen = []
    _wait(http, job["id"], lambda v: seen.append(v.get("preview_at")) or v["status"] == "completed")
    assert not any(seen)
    refused = http.post("/v1/videos", json={"prompt": "a fox", "preview_every": 1000})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "preview_every"


def test_time_left_counts_the_forwards_to_come_and_the_stages_after_them():
    from h3gen.server.job import Job
    from h3gen.server.job_worker import JobWorker, _Running

    worker = JobWorker(None, None, None)
    worker.tail_seconds = 3.0  # decode and write took 3 s in the last job
    running = _Running(Job(id="x", status="running", created_at=0.0, request={"forwards": 10}))
    running.forward_seconds, running.forwards_timed = 4.0, 4  # 1 s a forward so far
    assert worker._time_left(running, "denoise", 4, 10, 0.0) == 6 + 3
    running.window = (0, 2)  # a long clip: the next window's forwards and stages too
    assert worker._time_left(running, "denoise", 4, 10, 0.0) == 6 + 3 + 10 + 3
    running.window, running.denoise_ended = (1, 2), 100.0
    assert worker._time_left(running, "decode_video", 0, 1, 101.0) == 2.0
    running.window = (1, 3)
    assert worker._time_left(running, "encode_text", 0, 1, 0.0) == 2 * (10 + 3)
    assert worker._time_left(_Running(running.job), "encode_text", 0, 1, 0.0) is None  # nothing measured yet
