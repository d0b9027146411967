"""The real server (uvicorn subprocess on 127.0.0.1, tiny model) through HTTP: jobs, cancel, overload, restart."""

import concurrent.futures

import httpx
import pytest
from helpers.server_harness import Server, cancelled, done_running_queued, wait_for

from h3gen.client import H3Client, H3ClientError
from h3gen.media import probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

FAST = {"num_inference_steps": 3}
LONG = {"num_inference_steps": 1000}  # about ten seconds on the tiny model: long enough to act on while running


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def server(model, tmp_path):
    instance = Server(model, tmp_path / "results", max_queue=10)
    yield instance
    instance.stop()


def _mp4_ok(path, frames=124, rate=32000):
    info = probe_mp4(path)
    assert info.num_frames == frames and info.audio_channels == 2 and info.sample_rate == rate
    return info


def test_create_poll_download(server, tmp_path):
    with server.client() as http:
        created = http.post(
            "/v1/videos", json={"prompt": "a cat plays piano", "seed": 5, **FAST, "audio_sample_rate": 48000}
        )
        assert created.status_code == 202
        body = created.json()
        assert body["status"] == "queued" and len(body["id"]) == 32
        seen = []
        view = wait_for(http, body["id"], predicate=lambda v: seen.append(v["progress"]) or True)
        assert view["status"] == "completed" and view["progress"] == 100
        assert seen == sorted(seen)  # progress only moves forward
        assert view["request"]["seed"] == 5 and view["request"]["num_frames"] == 124
        assert {"encode_text", "denoise", "decode_video", "decode_audio", "write_mp4"} <= set(view["timings"])
        response = http.get(view["content_url"])
        assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
        (tmp_path / "got.mp4").write_bytes(response.content)
        _mp4_ok(tmp_path / "got.mp4", rate=48000)
        partial = http.get(view["content_url"], headers={"Range": "bytes=0-99"})
        assert partial.status_code == 206 and len(partial.content) == 100
        listing = http.get("/v1/videos", params={"limit": 5}).json()
        assert listing["data"][0]["id"] == body["id"]
        metrics = http.get("/metrics").text
        assert 'h3gen_jobs{status="succeeded"} 1' in metrics and "h3gen_step_seconds_count" in metrics
    # The Python client does the same round trip.
    view = H3Client(server.url).generate("waves at night", seed=2, out=tmp_path / "client.mp4", **FAST)
    assert view["status"] == "completed"
    _mp4_ok(tmp_path / "client.mp4")


def test_cancel_running_job_frees_the_engine_and_next_job_runs(server, tmp_path):
    with server.client() as http:
        long_job = http.post("/v1/videos", json={"prompt": "a very long job", **LONG}).json()["id"]
        next_job = http.post("/v1/videos", json={"prompt": "the next job", **FAST}).json()["id"]
        wait_for(http, long_job, statuses=("in_progress",), predicate=lambda v: v["progress"] > 5)
        answer = http.delete(f"/v1/videos/{long_job}")
        assert answer.status_code == 200 and cancelled(answer.json()["video"])
        view = wait_for(http, next_job)
        assert view["status"] == "completed"
        final = http.get(f"/v1/videos/{long_job}").json()
        assert cancelled(final) and final["progress"] < 99
        assert http.get(f"/v1/videos/{long_job}/content").status_code == 410
        assert not (tmp_path / "results" / f"{long_job}.mp4").exists()
        assert http.get("/health").json()["running"] is None


def test_cancel_queued_job_and_delete_finished_job(server):
    with server.client() as http:
        blocker = http.post("/v1/videos", json={"prompt": "blocker", **LONG}).json()["id"]
        queued = http.post("/v1/videos", json={"prompt": "waiting", **FAST}).json()["id"]
        assert http.get(f"/v1/videos/{queued}").json()["queue_position"] == 1
        assert cancelled(http.delete(f"/v1/videos/{queued}").json()["video"])
        http.delete(f"/v1/videos/{blocker}")
        done = http.post("/v1/videos", json={"prompt": "done", **FAST}).json()["id"]
        wait_for(http, done)
        assert http.delete(f"/v1/videos/{done}").json()["deleted"] is True
        assert http.get(f"/v1/videos/{done}").status_code == 404
        assert http.get(f"/v1/videos/{done}/content").status_code == 404


def test_fifty_concurrent_submissions_with_a_queue_of_ten(server, tmp_path):
    def submit(index):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return http.post("/v1/videos", json={"prompt": f"clip {index}", "seed": index, **FAST})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(submit, range(50)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {202, 429}, codes
    accepted = [r.json()["id"] for r in responses if r.status_code == 202]
    assert 10 <= len(accepted) <= 11 + 10  # the queue holds 10 (+1 running); more only if jobs finished meanwhile
    assert all(r.headers.get("retry-after", "").isdigit() for r in responses if r.status_code == 429)
    with server.client() as http:
        for job_id in accepted:
            assert wait_for(http, job_id, timeout=300)["status"] == "completed"
            path = tmp_path / f"{job_id}.mp4"
            path.write_bytes(http.get(f"/v1/videos/{job_id}/content").content)
            _mp4_ok(path)


def test_a_restart_after_a_kill_keeps_finished_jobs_and_takes_the_running_one_back(model, tmp_path):
    results = tmp_path / "results"
    first = Server(model, results)
    with first.client() as http:
        done, running, queued = done_running_queued(http, FAST, LONG)
    first.kill()
    second = Server(model, results)
    try:
        with second.client() as http:
            assert http.get(f"/v1/videos/{done}/content").status_code == 200
            # Killed mid-job: the job lost its worker once, so it is queued again (or running) on the next start.
            view = http.get(f"/v1/videos/{running}").json()
            assert view["status"] in ("queued", "in_progress") and view["error"] is None
            assert http.delete(f"/v1/videos/{running}").status_code == 200  # long: let the queued one have its turn
            assert wait_for(http, queued)["status"] == "completed"  # nothing queued is lost
    finally:
        second.stop()


def test_client_reports_server_errors(server):
    client = H3Client(server.url)
    with pytest.raises(H3ClientError) as info:
        client.create("x", seconds=61)  # over the server's --max-seconds (60)
    assert info.value.status == 422 and "seconds" in str(info.value)


def test_ref2va_job_with_uploaded_references(server, tmp_path):
    from helpers.media_files import moving_frames, tone, write_audio, write_video
    from PIL import Image

    Image.new("RGB", (70, 40), (200, 40, 40)).save(tmp_path / "hat.png")
    write_audio(tmp_path / "song.mp3", tone(6.3, 44100), 44100)
    write_video(tmp_path / "walk.mp4", moving_frames(36, 64, 48), 30, tone(1.5, 48000), 48000)
    client = H3Client(server.url)
    # The client keys each file by its suffix; the parts keep this order, which is the references' order.
    view = client.generate(
        "a man in <Picture 1> walks like <Video 1> to <Audio 1>",
        out=tmp_path / "out.mp4",
        references=[tmp_path / "hat.png", tmp_path / "walk.mp4", tmp_path / "song.mp3"],
        num_inference_steps=2,
        seed=1,
        timeout=120,
    )
    assert view["request"]["task"] == "ref2va" and view["request"]["references"] == ["image", "video", "audio"]
    # No seconds: the length of the first reference with sound (the video's 1.5 s soundtrack, held at 5 s).
    _mp4_ok(tmp_path / "out.mp4", frames=124)
    with server.client() as http:
        handles = [
            ("ref_image", ("hat.png", open(tmp_path / "hat.png", "rb"))),
            ("ref_audio", ("song.mp3", open(tmp_path / "song.mp3", "rb"))),
        ]
        created = http.post(
            "/v1/videos", data={"prompt": "x", "task": "ref2va", "num_inference_steps": "2"}, files=handles
        )
        for _, (_, handle) in handles:
            handle.close()
        assert created.status_code == 202, created.text
        done = wait_for(http, created.json()["id"])
        assert done["status"] == "completed", done
        assert done["request"]["num_frames"] == 158  # the song's 6.3 s
