"""The server as an attacker or an operator would try it: memory from a small file, a full queue or disk, the
stored name of an upload, security headers, the key on every route but /health, throttled guesses, and every
aspect ratio validation accepts running to the end."""

import io
import socket
import threading
import time

import httpx
import pytest
from helpers.media_files import bomb_png
from helpers.server_harness import Server, memory_kb, wait_for
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "hardening-key-0815"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hardening")


@pytest.fixture(scope="module")
def server(root):
    instance = Server(tiny_checkpoint(cache_dir=root / "cache"), root / "results", api_key=KEY, max_queue=2)
    yield instance
    instance.stop()


def _png(size=(80, 45)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def _field(response):
    return response.json()["detail"][0]["loc"][-1]


@pytest.mark.parametrize(
    "path,field,data",
    [
        ("/v1/videos", "image", {"prompt": "x", "task": "fl2va"}),
        ("/v1/videos", "ref_image", {"prompt": "x", "task": "ref2va"}),
        ("/v1/prompts/plan", "image", {"prompt": "x"}),
    ],
)
def test_a_small_file_with_a_huge_canvas_is_refused_before_decoding(server, root, path, field, data):
    bomb = root / "bomb.png"
    if not bomb.exists():
        bomb_png(bomb)  # 13,000 x 13,000 pixels in 160 KB
    peak = memory_kb(server.process.pid, "VmHWM")
    with server.client() as http:
        started = time.perf_counter()
        response = http.post(path, data=data, files={field: ("bomb.png", bomb.read_bytes(), "image/png")})
        assert response.status_code == 422 and _field(response) == field, response.text
        assert "at most 40 MP" in response.text
        assert time.perf_counter() - started < 5.0
    assert memory_kb(server.process.pid, "VmHWM") - peak < 100 * 1024  # decoding it would take 170-500 MB


def test_uploads_are_named_by_their_content_and_refused_when_of_the_wrong_kind(server, root):
    html = b"<html><body><script>alert(document.cookie)</script></body></html>"
    with server.client() as http:
        as_html = http.post(
            "/v1/videos", data={"prompt": "x", "task": "fl2va"}, files={"image": ("x.html", html, "text/html")}
        )
        assert as_html.status_code == 422 and _field(as_html) == "image", as_html.text
        png_as_video = http.post(
            "/v1/videos", data={"prompt": "x", "task": "ref2va"}, files={"ref_video": ("clip.mp4", _png(), "video/mp4")}
        )
        assert png_as_video.status_code == 422 and _field(png_as_video) == "ref_video", png_as_video.text
        accepted = http.post(
            "/v1/videos",
            data={"prompt": "x", "task": "fl2va", "num_inference_steps": "1000"},
            files={"image": ("x.html", _png(), "text/html")},
        )
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        stored = sorted(path.name for path in (root / "results" / "uploads" / job_id).iterdir())
        assert stored == ["image.png"]  # the client's ".html" is gone
        assert http.delete(f"/v1/videos/{job_id}").status_code == 200
        wait_for(http, job_id, timeout=60)


def test_security_headers_on_every_response(server):
    with server.client() as http:
        responses = [
            http.get("/health"),
            http.get("/v1/videos"),
            http.get("/v1/videos/" + "a" * 32),
            http.post("/v1/videos", json={"prompt": ""}),
            http.get("/nowhere"),
            http.get("/docs"),
            httpx.get(f"{server.url}/v1/videos"),
        ]
    assert [response.status_code for response in responses] == [200, 200, 404, 422, 404, 200, 401]
    for response in responses:
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert "default-src 'none'" in responses[1].headers["content-security-policy"]


def test_documentation_needs_the_key_and_health_shows_readiness_only_without_it(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 401
    with server.client() as http:
        assert http.get("/openapi.json").json()["paths"]["/v1/videos"]
        assert "swagger" in http.get("/docs").text.lower() and "redoc" in http.get("/redoc").text.lower()
        full = http.get("/health").json()
    assert full["ready"] and full["devices"] == ["cpu"] and "/" not in full["model"] and full["queue_depth"] == 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "ready": True}


def test_wrong_keys_are_backed_off_per_client(server):
    transport = httpx.HTTPTransport(local_address="127.0.0.9")
    with httpx.Client(base_url=server.url, transport=transport) as http:
        wrong, right = {"Authorization": "Bearer guess"}, {"Authorization": f"Bearer {KEY}"}
        assert [http.get("/v1/videos", headers=wrong).status_code for _ in range(6)] == [401] * 6
        locked = http.get("/v1/videos", headers=wrong)
        assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
        assert http.get("/v1/videos", headers=right).status_code == 429  # the right key waits too
        for forged in range(12):  # a forwarding header from a peer that is no named proxy changes nothing
            headers = {**wrong, "X-Forwarded-For": f"198.51.100.{forged}", "X-Real-IP": f"198.51.100.{forged}"}
            assert http.get("/v1/videos", headers=headers).status_code == 429
        assert http.get("/health", headers=right).json().keys() == {"status", "ready"}
        with server.client() as other:  # another client is not affected
            assert other.get("/v1/videos").status_code == 200
        time.sleep(int(locked.headers["retry-after"]))
        assert http.get("/v1/videos", headers=right).status_code == 200
        assert http.get("/v1/videos", headers=wrong).status_code == 401  # the right key forgave the failures


def test_the_extreme_aspect_ratios_run(server):
    """4:1 and 1:4 passed validation and then failed every job on the tiny model ("got 160x32"); every ratio in
    between is checked against the model's size rule in test_uploads.py."""
    with server.client() as http:
        wide = http.post(
            "/v1/videos", json={"prompt": "a wide shot", "aspect_ratio": "4:1", "num_inference_steps": 2, "seed": 1}
        )
        tall = http.post(
            "/v1/videos",
            data={"prompt": "x", "task": "fl2va", "num_inference_steps": "2"},
            files={"image": ("tall.png", _png((40, 160)), "image/png")},
        )
        for created in (wide, tall):
            assert created.status_code == 202, created.text
        for created in (wide, tall):
            view = wait_for(http, created.json()["id"], timeout=300)
            assert view["status"] == "completed", view["error"]
            assert 1 / 4 <= view["request"]["width"] / view["request"]["height"] <= 4


def test_a_full_queue_answers_before_reading_the_upload(server):
    with server.client() as http:
        jobs = []
        for _ in range(4):
            response = http.post("/v1/videos", json={"prompt": "slow", "num_inference_steps": 1000})
            if response.status_code == 429:
                break
            jobs.append(response.json()["id"])
        assert response.status_code == 429 and len(jobs) == 3  # one running, two waiting
        try:
            # Announce a 900 KB upload and send only its first bytes: the answer must come without the rest.
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(
                    b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + KEY.encode()
                    + b"\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 900000\r\n\r\n"
                    + b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
                )
                answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 429") and b"retry-after" in answer.lower(), answer[:200]
        finally:
            for job_id in jobs:
                http.delete(f"/v1/videos/{job_id}")
            for job_id in jobs:
                wait_for(http, job_id, timeout=60)


def test_ui_logins_are_backed_off(root):
    ui_server = Server(tiny_checkpoint(cache_dir=root / "cache"), root / "ui-results", api_key=KEY, ui=True)
    try:
        transport = httpx.HTTPTransport(local_address="127.0.0.11")
        with httpx.Client(base_url=ui_server.url, transport=transport) as http:

            def login(password):
                return http.post("/ui/login", data={"username": "me", "password": password})

            assert [login("guess").status_code for _ in range(6)] == [400] * 6  # Gradio's wrong-login answer
            locked = login("guess")
            assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
            assert login(KEY).status_code == 429
            forged = http.post(
                "/ui/login", data={"username": "me", "password": "guess"}, headers={"X-Forwarded-For": "198.51.100.7"}
            )
            assert forged.status_code == 429
            time.sleep(int(locked.headers["retry-after"]))
            assert login(KEY).status_code == 200
    finally:
        ui_server.stop()


def test_a_full_disk_is_a_507_and_the_server_stays_up(root):
    import uvicorn

    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager

    class FullDisk(JobManager):
        """Uploads land on a device that is always full (writes to /dev/full fail with ENOSPC)."""

        def staging_dir(self):
            folder = super().staging_dir()
            for name in ("image", "last_image"):
                (folder / f"{name}.upload").symlink_to("/dev/full")
            return folder

    engine = H3Engine(tiny_checkpoint(cache_dir=root / "cache"), device="cpu")
    manager = FullDisk(engine, root / "full-results", max_queue=2)
    port = Server.__init__.__globals__["free_port"]()
    uvicorn_server = uvicorn.Server(
        uvicorn.Config(create_app(manager), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            response = http.post(
                "/v1/videos", data={"prompt": "x", "task": "fl2va"}, files={"image": ("a.png", _png(), "image/png")}
            )
            assert response.status_code == 507 and "disk is full" in response.json()["detail"], response.text
            assert response.headers.get("connection") != "close"
            assert http.get("/health").json()["status"] == "ok"
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)
