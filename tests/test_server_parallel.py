"""`h3gen serve --ulysses 2` (two processes under torchrun, gloo on the CPU): jobs run on both ranks, a failure on
one rank fails only that job with its message, cancellation stops both ranks, and the next job succeeds."""

import os
from pathlib import Path

import pytest
from helpers.server_harness import Server, cancelled, wait_for

from h3gen.media import probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

# Rank 1 fails at denoising step 2 of jobs whose prompt says "boom" (tests/fault_injection/sitecustomize.py).
FAULT = {
    "H3GEN_TEST_FAULT": "rank=1,step=2,prompt=boom",
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent / "fault_injection"), os.environ.get("PYTHONPATH")])
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-server")
    instance = Server(
        tiny_checkpoint(cache_dir=root / "cache"),
        root / "results",
        extra=("--ulysses", "2"),
        env=FAULT,
        ready_timeout=150,
    )
    yield instance
    instance.stop()


def test_jobs_failures_and_cancellation_across_ranks(server, tmp_path):
    with server.client() as http:
        assert "ulysses 2" in http.get("/health").json()["devices"][0]
        ok = http.post("/v1/videos", json={"prompt": "a cat", "num_inference_steps": 4, "seed": 1}).json()["id"]
        bad = http.post("/v1/videos", json={"prompt": "boom", "num_inference_steps": 4, "seed": 1}).json()["id"]
        after = http.post("/v1/videos", json={"prompt": "after", "num_inference_steps": 4, "seed": 2}).json()["id"]
        assert wait_for(http, ok)["status"] == "completed"
        failed = wait_for(http, bad)
        message = failed["error"]["message"]
        assert failed["status"] == "failed" and "rank 1" in message and "injected failure" in message
        assert wait_for(http, after)["status"] == "completed"
        (tmp_path / "ok.mp4").write_bytes(http.get(f"/v1/videos/{ok}/content").content)
        assert probe_mp4(tmp_path / "ok.mp4").num_frames == 124

        long_job = http.post("/v1/videos", json={"prompt": "long", "num_inference_steps": 1000}).json()["id"]
        wait_for(http, long_job, statuses=("in_progress",), predicate=lambda v: v["progress"] > 5)
        assert cancelled(http.delete(f"/v1/videos/{long_job}").json()["video"])
        last = http.post("/v1/videos", json={"prompt": "last", "num_inference_steps": 4}).json()["id"]
        assert wait_for(http, last)["status"] == "completed"
        assert http.get("/health").json()["status"] == "ok"
