"""Bad input against the real server: every mistake is a clear 4xx naming the problem, and /health stays ok."""

import json

import pytest
from helpers.server_harness import Server
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "s3cret-test-key-4711"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    instance = Server(
        tiny_checkpoint(cache_dir=root / "cache"),
        root / "results",
        api_key=KEY,
        max_queue=2,
        extra=("--max-upload-mb", "1"),
    )
    yield instance
    instance.stop()
    assert KEY not in instance.log_path.read_text()  # the key is never logged


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    Image.new("RGB", (80, 45), (10, 200, 30)).save(folder / "ok.png")
    (folder / "notes.txt").write_text("not an image at all")
    png = (folder / "ok.png").read_bytes()
    (folder / "cut.png").write_bytes(png[: len(png) // 3])
    (folder / "big.png").write_bytes(png + b"\0" * (2 * 2**20))
    from helpers.media_files import moving_frames, tone, write_audio, write_video

    write_audio(folder / "voice.wav", tone(1.0, 32000), 32000)
    write_video(folder / "clip.mp4", moving_frames(20, 48, 64), 24)
    clip = (folder / "clip.mp4").read_bytes()
    (folder / "cut.mp4").write_bytes(clip[: len(clip) // 3])
    write_audio(folder / "long.wav", tone(61.0, 8000, channels=1), 8000)
    return folder


def _field(response):
    detail = response.json()["detail"]
    return detail[0]["loc"][-1] if isinstance(detail, list) else None


JSON_CASES = [
    ({"prompt": "x", "seconds": "abc"}, 422, "seconds"),
    ({"prompt": "x", "num_inference_steps": 3.5}, 422, "num_inference_steps"),
    ({"prompt": "x", "seed": "lucky"}, 422, "seed"),
    ({"prompt": 123}, 422, "prompt"),
    ({"prompt": ""}, 422, "prompt"),
    ({"seconds": 5}, 422, "prompt"),
    ({"prompt": "x", "task": "t2i"}, 422, "task"),
    ({"prompt": "x", "aspect_ratio": "wide"}, 422, "aspect_ratio"),
    ({"prompt": "x", "aspect_ratio": "16/9"}, 422, "aspect_ratio"),
    ({"prompt": "x", "aspect_ratio": "1:5"}, 422, "aspect_ratio"),
    ({"prompt": "x", "audio_sample_rate": 44100}, 422, "audio_sample_rate"),
    ({"prompt": "x", "negative_prompt": "blurry"}, 422, "negative_prompt"),
    ({"prompt": "x", "seconds": 2}, 422, "seconds"),
    ({"prompt": "x", "seconds": 61}, 422, "seconds"),  # over the server's --max-seconds (60)
    ({"prompt": "x", "seconds": 301}, 422, "seconds"),  # over any server's
    ({"prompt": "x", "seconds": 30, "prompts": ["a", "b"]}, 422, "prompts"),
    ({"prompt": "x", "seconds": 30, "window_frames": 250}, 422, "window_frames"),
    ({"prompt": "x", "seconds": 30, "overlap_frames": 277}, 422, "overlap_frames"),
    ({"prompt": "x", "num_inference_steps": 1}, 422, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 5000}, 422, "num_inference_steps"),
    ({"prompt": "x", "seed": -1}, 422, "seed"),
    ({"prompt": "x", "seed": 2**64}, 422, "seed"),
    ({"prompt": "x" * 5000}, 422, "prompt"),
    ({"prompt": "x", "task": "fl2va"}, 422, "image"),
    ({"prompt": "x", "task": "ref2va"}, 422, "references"),
    ({"prompt": "x", "quality": "high", "cache": {"threshold": 2}}, 422, "threshold"),
    ({"prompt": "x", "quality": "high", "cache": "fast"}, 422, "cache"),
    ({"prompt": "x", "cache": {"warmup": 1}}, 422, "cache"),  # the server's tier (lossless) has no step cache
    ({"prompt": "x", "sparsity": 1.0}, 422, "sparsity"),
    ({"prompt": "x", "sparsity": "most"}, 422, "sparsity"),
    ({"prompt": "x", "num_inference_steps": 4, "sparsity": [0.5, 0.5]}, 422, "sparsity"),  # 3 forwards, 2 values
    ({"prompt": "x", "num_inference_steps": 4, "sparsity": 0.5, "dense_forwards": 4}, 422, "dense_forwards"),
    ({"prompt": "x", "dense_forwards": 1}, 422, "dense_forwards"),  # without sparsity
]


@pytest.mark.parametrize("body,status,field", JSON_CASES)
def test_bad_json_fields(server, body, status, field):
    with server.client() as http:
        response = http.post("/v1/videos", json=body)
        assert response.status_code == status, response.text
        assert _field(response) == field, response.text
        assert http.get("/health").json()["status"] == "ok"


def test_bad_aspect_ratio_reads_like_the_cli(server):
    with server.client() as http:
        response = http.post("/v1/videos", json={"prompt": "x", "aspect_ratio": "wide"})
        assert response.status_code == 422 and _field(response) == "aspect_ratio"
        assert response.json()["detail"][0]["msg"].startswith("aspect_ratio must look like 16:9"), response.text


@pytest.mark.parametrize("seconds", [2, 61, 301])
def test_length_refusal_names_the_limit_in_force(server, seconds):
    """The words of the CLI and the pipeline: "seconds must be from 5 to N", N this server's --max-seconds (60)."""
    with server.client() as http:
        response = http.post("/v1/videos", json={"prompt": "x", "seconds": seconds})
        assert response.status_code == 422 and _field(response) == "seconds", response.text
        assert response.json()["detail"][0]["msg"] == f"seconds must be from 5 to 60 (got {seconds}).", response.text


def _deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/prompts/plan"])
@pytest.mark.parametrize(
    "content",
    [
        _deep(5_000),
        _deep(20_000),
        b"[" * 30_000,
        b'{"a": ' + b'{"a": ' * 9000 + b"1" + b"}" * 9001,
        b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}",
        b'{"prompt": "x", "max_tokens": -' + b"9" * 5000 + b"}",
    ],
)
def test_deep_or_huge_json_is_a_422_on_a_live_connection(server, path, content):
    with server.client() as http:
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text[:300]
        assert _field(response) == "body" and ("deep" in response.text or "digits" in response.text)
        assert response.headers.get("connection") != "close"
        assert http.get("/health").json()["status"] == "ok"  # on the same connection


@pytest.mark.parametrize(
    "data,field",
    [
        ([("prompt", b"\xff\xfe")], "prompt"),  # not UTF-8: JSON refuses the same bytes
        ([("prompt", b"a cat"), ("prompt", b"a dog")], "prompt"),
        ([("prompt", b"a cat"), ("seed", b"1"), ("seed", b"2")], "seed"),
        ([("prompt", b"a cat"), ("seed", b"")] * 2, "prompt"),
        ([("prompt", b"a cat"), ("seed", b"7" * 5000)], "seed"),
    ],
)
def test_multipart_fields_agree_with_json(server, data, field):
    import uuid

    boundary = uuid.uuid4().hex
    body = (
        b"".join(
            b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'
            % (boundary.encode(), name.encode(), value)
            for name, value in data
        )
        + b"--%s--\r\n" % boundary.encode()
    )
    with server.client() as http:
        response = http.post(
            "/v1/videos", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
        assert response.status_code == 422, response.text
        assert _field(response) == field, response.text
        assert http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "content,content_type,status",
    [
        (b"{not json", "application/json", 422),
        (b"[1, 2, 3]", "application/json", 422),
        (b"", "application/json", 422),
        (b"prompt=hello", "text/plain", 415),
        # A JSON body holds at most 64 KB besides an input_reference data URL (which may take up to the upload limit):
        # a 1 MB prompt is a 413 once parsed, a body past the data URL's limit is refused before it is read.
        pytest.param(json.dumps({"prompt": "x" * (1 << 20)}).encode(), "application/json", 413, id="1MB-prompt"),
        pytest.param(json.dumps({"prompt": "x" * (30 << 20)}).encode(), "application/json", 413, id="30MB-body"),
    ],
)
def test_bad_bodies(server, content, content_type, status):
    with server.client() as http:
        response = http.post("/v1/videos", content=content, headers={"content-type": content_type})
        assert response.status_code == status, response.text
        assert http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "upload,field,status,message",
    [
        ("notes.txt", "image", 422, "not a readable image"),
        ("cut.png", "image", 422, "not a readable image"),
        ("cut.png", "last_image", 422, "not a readable image"),
        ("big.png", "image", 422, "upload limit"),
    ],
)
def test_bad_uploads(server, files, upload, field, status, message):
    with server.client() as http:
        with open(files / upload, "rb") as handle:
            response = http.post("/v1/videos", data={"prompt": "x", "task": "fl2va"}, files={field: handle})
        assert response.status_code == status, response.text
        assert _field(response) == field and message in response.text
        assert "staging-" not in response.text and str(server.log_path.parent) not in response.text
        assert http.get("/health").json()["status"] == "ok"


def test_uploads_in_the_wrong_place(server, files):
    with server.client() as http:
        with open(files / "ok.png", "rb") as handle:
            t2va = http.post("/v1/videos", data={"prompt": "x", "task": "t2va"}, files={"image": handle})
        assert t2va.status_code == 422 and _field(t2va) == "image"
        with open(files / "ok.png", "rb") as handle:
            other = http.post("/v1/videos", data={"prompt": "x", "task": "fl2va"}, files={"avatar": handle})
        assert other.status_code == 422 and _field(other) == "avatar"
        accepted = http.post(
            "/v1/videos",
            data={"prompt": "x", "task": "fl2va", "num_inference_steps": "2"},
            files={"image": open(files / "ok.png", "rb")},
        )
        assert accepted.status_code == 202, accepted.text


@pytest.mark.parametrize(
    "path",
    [
        "/v1/videos/..%2F..%2Fetc%2Fpasswd",
        "/v1/videos/../../etc/passwd",
        "/v1/videos/abc",
        "/v1/videos/" + "0" * 32,
        "/v1/videos/%00",
        "/v1/videos/..%2F..%2Fetc%2Fpasswd/content",
        "/v1/videos/" + "f" * 32 + "/content",
    ],
)
def test_bad_ids(server, path):
    with server.client() as http:
        for method in ("GET", "DELETE"):
            response = http.request(method, path)
            assert 400 <= response.status_code < 500, (method, path, response.status_code)
            assert "root:" not in response.text
        assert http.get("/health").json()["status"] == "ok"


def test_bad_pagination(server):
    with server.client() as http:
        for params in ({"limit": 0}, {"limit": 1000}, {"order": "sideways"}, {"after": "../x"}):
            assert 400 <= http.get("/v1/videos", params=params).status_code < 500


@pytest.mark.parametrize(
    "client,headers",
    [
        (2, {}),
        (3, {"Authorization": "Bearer wrong"}),
        (4, {"Authorization": KEY}),
        (5, {"Authorization": "Basic " + KEY}),
    ],
)
def test_missing_or_wrong_key(server, client, headers):
    import httpx

    # Each case from its own loopback address: wrong keys are throttled per client after a few.
    transport = httpx.HTTPTransport(local_address=f"127.0.0.{client}")
    with httpx.Client(base_url=server.url, headers=headers, transport=transport) as http:
        for method, path in (
            ("POST", "/v1/videos"),
            ("GET", "/v1/videos"),
            ("GET", "/metrics"),
            ("GET", "/v1/videos/" + "a" * 32),
            ("DELETE", "/v1/videos/" + "a" * 32),
            ("GET", "/docs"),
            ("GET", "/redoc"),
            ("GET", "/openapi.json"),
        ):
            response = http.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert response.status_code in ((401, 429) if headers else (401,)), (method, path)
            if response.status_code == 401:
                assert response.headers["www-authenticate"] == "Bearer"
        health = http.get("/health")
        assert health.status_code == 200 and health.json().keys() == {"status", "ready"}  # readiness only


@pytest.mark.parametrize(
    "parts,field,message",
    [
        ([("ref_audio", "voice.wav")], "ref_audio", "cannot be the only"),
        ([("ref_video", "cut.mp4")], "ref_video", "not a readable"),
        ([("ref_video", "notes.txt")], "ref_video", "not a readable"),
        ([("ref_image", "notes.txt")], "ref_image", "not a readable image"),
        ([("ref_image", "ok.png"), ("ref_audio", "clip.mp4")], "ref_audio", "no audio stream"),
        ([("ref_image", "ok.png"), ("ref_audio", "long.wav")], "ref_audio", "at most 60 s"),
        ([("ref_image", "ok.png")] * 10, "ref_image", "at most 9 image"),
        ([("ref_image", "big.png")], "ref_image", "upload limit"),
    ],
)
def test_bad_reference_uploads(server, files, parts, field, message):
    with server.client() as http:
        handles = [(name, (upload, open(files / upload, "rb"))) for name, upload in parts]
        try:
            response = http.post("/v1/videos", data={"prompt": "x", "task": "ref2va"}, files=handles)
        finally:
            for _, (_, handle) in handles:
                handle.close()
        assert response.status_code == 422, response.text
        assert _field(response) == field and message in response.text, response.text
        assert "staging-" not in response.text and str(server.log_path.parent) not in response.text
        assert http.get("/health").json()["status"] == "ok"


def test_references_only_with_ref2va_and_keyframes_not_with_it(server, files):
    with server.client() as http:
        with open(files / "ok.png", "rb") as handle:
            t2va = http.post("/v1/videos", data={"prompt": "x"}, files={"ref_image": handle})
        assert t2va.status_code == 422 and _field(t2va) == "ref_image", t2va.text
        with open(files / "ok.png", "rb") as handle:
            mixed = http.post("/v1/videos", data={"prompt": "x", "task": "ref2va"}, files={"image": handle})
        assert mixed.status_code == 422 and _field(mixed) == "image", mixed.text
        with open(files / "voice.wav", "rb") as handle:
            as_text = http.post(
                "/v1/videos", data={"prompt": "x", "task": "ref2va", "ref_image": "ok.png"}, files={"ref_audio": handle}
            )
        assert as_text.status_code == 422 and _field(as_text) == "ref_image", as_text.text


def test_auto_workflow_serves_ref2va_only_when_both_partitions_are_small(monkeypatch, tmp_path):
    from h3gen.offload import host_memory
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
    from h3gen.server.engine import H3Engine

    folder = tiny_checkpoint(cache_dir=tmp_path)
    assert "ref2va" in H3Engine(folder, device="cpu").tasks  # the tiny demo serves every task
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)  # as if the partitions were huge
    engine = H3Engine(folder, device="cpu")
    assert engine.tasks == ("t2va", "fl2va") and engine.load_workflow() == "fl2va"
    assert "ref2va" in H3Engine(folder, device="cpu", workflow="all").tasks
