"""What a request may make the server do before it is refused: bodies bounded after the key and before parsing,
JSON in bounded time off the event loop (and `/health` answering meanwhile), JSON inside string fields under the
same limits, error answers that never repeat the input, sound of any declared sample rate in bounded memory, and a
bounded number of prompt plans."""

import io
import json
import socket
import threading
import time

import httpx
import pytest
from helpers.media_files import wav_bytes
from helpers.server_harness import Server, memory_kb

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "limits-key-1234"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("limits")


@pytest.fixture(scope="module")
def server(root):
    instance = Server(tiny_checkpoint(cache_dir=root / "cache"), root / "results", api_key=KEY, max_queue=2)
    yield instance
    instance.stop()


def _raw(server, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
    """Send `head` (request line and headers) and `body` over a raw socket; the status and the answer's bytes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_huge_body_without_the_key_is_refused_before_it_is_read(server):
    """A 300 MB Content-Length gets its 401 (no key) or 413 (key) from the headers alone: the body never comes."""
    for route in ("/v1/videos/" + "a" * 32 + "/remix", "/v1/videos", "/v1/prompts/plan"):
        head = f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 300000000\r\n"
        status, _ = _raw(server, head)
        assert status == 401, route
        status, answer = _raw(server, head + f"Authorization: Bearer {KEY}\r\n")
        assert status == 413, (route, answer)


def test_a_body_that_streams_past_its_limit_is_stopped_there(server):
    """Chunked, with no Content-Length: the server stops at the route's limit (64 KB for a remix) with a 413."""
    chunk = b"x" * 16384
    body = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    head = (
        f"POST /v1/videos/{'a' * 32}/remix HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\nAuthorization: Bearer {KEY}\r\n"
    )
    status, answer = _raw(server, head, body)
    assert status == 413 and b"65536" in answer


def test_health_answers_in_100_ms_while_large_and_deep_bodies_are_parsed(server):
    """Bodies at the JSON limit (a data URL of 8 MB, four million tiny values, deep nesting) parse off the event
    loop or are refused before parsing, one after another: /health keeps answering."""
    data_url = "data:image/png;base64," + "A" * (8 * 2**20 - 100)
    bodies = [
        json.dumps({"prompt": "x", "input_reference": {"image_url": data_url}}).encode(),
        b'{"prompt": "x", "cache": [' + b"1," * (4 * 2**20) + b"1]}",
        b'{"prompt": ' + b"[" * 60000 + b"]" * 60000 + b"}",
    ]
    done = threading.Event()
    statuses = []
    head = (
        f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nConnection: close\r\n"
    )

    def send():  # raw sockets: sendall leaves the GIL to the probe below, so the figure is the server's
        while not done.is_set():
            for body in bodies:
                statuses.append(_raw(server, head + f"Content-Length: {len(body)}\r\n", body, timeout=120)[0])

    senders = [threading.Thread(target=send)]
    for thread in senders:
        thread.start()
    latencies = []
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            time.sleep(0.5)
            for _ in range(60):
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.05)
    finally:
        done.set()
        for thread in senders:
            thread.join()
    assert statuses and all(status < 500 for status in statuses), statuses
    latencies.sort()
    assert latencies[int(0.99 * (len(latencies) - 1))] <= 0.1, latencies[-5:]


@pytest.mark.parametrize("field", ["cache", "loras", "prompts"])
@pytest.mark.parametrize("form", [False, True])
def test_deep_json_inside_string_fields_is_a_422_not_a_500(server, field, form):
    text = "[" * 5000 + "]" * 5000
    body = {"prompt": "x", "quality": "high", field: text}
    with server.client() as http:
        parts = [(name, (None, value)) for name, value in body.items()]  # a multipart form of text fields
        response = http.post("/v1/videos", files=parts) if form else http.post("/v1/videos", json=body)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"][0]
        assert detail["loc"][-1] == field and "deep" in detail["msg"], detail
        assert http.get("/health").json()["status"] == "ok"


def test_an_error_answer_repeats_no_more_than_an_excerpt_of_the_input(server):
    with server.client() as http:
        for body in ({"prompt": "y" * 60000}, {"prompt": "x", "nope": "z" * 60000}):
            response = http.post(f"/v1/videos/{'a' * 32}/remix", json=body)
            assert response.status_code == 422, response.text
            assert len(response.content) < 2000, len(response.content)
        big = http.post("/v1/videos", json={"prompt": "p" * 70000})  # 64 KB and no data URL
        assert big.status_code == 413 and len(big.content) < 2000


def _ref2va_with_sound(server, rate: int) -> dict:
    """Run a ref2va job whose audio reference is a 16 KB WAV at `rate`; its final `Video` object."""
    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(picture, "PNG")
    with server.client() as http:
        response = http.post(
            "/v1/videos",
            data={"prompt": "x", "task": "ref2va", "num_inference_steps": "2"},
            files=[
                ("ref_image", ("a.png", picture.getvalue(), "image/png")),
                ("ref_audio", ("a.wav", wav_bytes(rate, 8000), "audio/wav")),
            ],
        )
        assert response.status_code == 202, response.text
        job = response.json()["id"]
        deadline = time.monotonic() + 240
        while (view := http.get(f"/v1/videos/{job}").json())["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, view
            time.sleep(0.2)
    return view


@pytest.fixture(scope="module")
def warm(server):
    """One ref2va job at an ordinary rate first, so what a job allocates once is not counted against a rate."""
    assert _ref2va_with_sound(server, 32000)["status"] == "completed"


@pytest.mark.parametrize("rate", [1009, 4001, 8009, 44101, 384000])
def test_sound_of_an_odd_sample_rate_is_resampled_in_bounded_memory(server, warm, rate):
    """A 16 KB WAV at a rate with a small common divisor with 32 kHz: the filter built from the ratio would take
    gigabytes (1009 Hz: 1.5 GB, 44101 Hz: one 11 GB tensor); the job runs and the server grows by little."""
    before = memory_kb(server.process.pid)
    view = _ref2va_with_sound(server, rate)
    assert view["status"] == "completed", view
    # a job's own allocations move the figure by up to about 250 MB between runs; the filter took 1.5 to 11 GB
    assert memory_kb(server.process.pid) - before < 500 * 1024


@pytest.mark.parametrize("rate", [1, 999, 384001, 768000])
def test_a_sample_rate_outside_the_range_is_a_422_naming_it(server, rate):
    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(picture, "PNG")
    with server.client() as http:
        response = http.post(
            "/v1/videos",
            data={"prompt": "x", "task": "ref2va"},
            files=[
                ("ref_image", ("a.png", picture.getvalue(), "image/png")),
                ("ref_audio", ("a.wav", wav_bytes(rate, 4000), "audio/wav")),
            ],
        )
        assert response.status_code == 422, response.text
        message = response.json()["detail"][0]["msg"]
        assert f"got {rate}" in message and "1000 to 384000 Hz" in message, message


class _SlowPlanner:
    accepts_images = False

    def plan(self, prompt, **options):
        time.sleep(1.5)
        return type(
            "Plan",
            (),
            {"prompt": prompt, "planned": prompt + " (planned)", "backend": "slow", "tokens": 3, "seconds": 1.5},
        )()


class _PlannerEngine:
    load_error, ready, model_path, tasks = None, True, None, ("t2va",)
    planner = _SlowPlanner()

    def load(self) -> None:
        pass

    def devices(self):
        return []


def test_prompt_plans_have_a_bounded_queue(tmp_path):
    """One plan runs and two wait (--max-plan-queue 2); the rest are 429 with Retry-After, and all admitted ones
    finish."""
    from fastapi.testclient import TestClient

    from h3gen.server.app import create_app
    from h3gen.server.jobs import JobManager

    manager = JobManager(_PlannerEngine(), tmp_path / "results")
    app = create_app(manager, max_plan_queue=2)
    answers = []
    with TestClient(app) as client:

        def plan(index):
            answers.append(client.post("/v1/prompts/plan", json={"prompt": f"idea {index}"}))

        threads = [threading.Thread(target=plan, args=(index,)) for index in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200, 200, 200, 429, 429, 429], [answer.text for answer in answers]
    refused = [answer for answer in answers if answer.status_code == 429]
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in refused)
