"""The web UI as an attacker sees it, through the real `h3gen serve` on 127.0.0.1: it reads only what a user
uploaded through it and the MP4s of jobs the server holds, and serves user content under a strict policy."""

import json
import re
from contextlib import contextmanager

import httpx
import pytest
from helpers.server_harness import Server, memory_kb, wait_for

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.ui.actions import GENERATE_INPUTS

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "ui-security-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-security")
    gradio_tmp = root / "gradio-tmp"
    instance = Server(
        tiny_checkpoint(cache_dir=root / "cache"),
        root / "results",
        ui=True,
        api_key=KEY,
        env={"GRADIO_TEMP_DIR": str(gradio_tmp)},
        extra=("--max-upload-mb", "1"),
    )
    instance.gradio_tmp = gradio_tmp
    instance.results_dir = root / "results"
    yield instance
    instance.stop()


@contextmanager
def ui_client(server):
    """A browser-like session: logged in to the UI with the key as its password."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answer = client.post("/ui/login", data={"username": "someone", "password": KEY})
        assert answer.status_code == 200, answer.text
        yield client


def call(client: httpx.Client, endpoint: str, data: list) -> tuple[str, object]:
    """One call of a UI endpoint through Gradio's HTTP API: the last event's kind and its data."""
    answer = client.post(f"/ui/gradio_api/call/{endpoint}", json={"data": data})
    assert answer.status_code == 200, answer.text
    event_id = answer.json()["event_id"]
    kind, payload = None, None
    with client.stream("GET", f"/ui/gradio_api/call/{endpoint}/{event_id}", timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                payload = json.loads(line.split(":", 1)[1].strip() or "null")
    return kind, payload


def generate_inputs(**overrides) -> list:
    values = dict(
        prompt="a cat",
        task="t2va",
        image=None,
        last_image=None,
        references=None,
        aspect="auto",
        seconds=5,
        steps=2,
        seed=1,
        randomize=False,
        plan=False,
        window_prompts="",
        window_frames=None,
        overlap_frames=None,
        quality="lossless",
        loras={"headers": ["LoRA", "recipe", "scale"], "data": []},
        preview_every=None,
        sparsity="",
        dense_forwards=None,
    )  # the picker, empty
    values.update(overrides)
    return [values[name] for name in GENERATE_INPUTS]


def file_data(path: str) -> dict:
    return {"path": path, "meta": {"_type": "gradio.FileData"}}


def named_paths(text: str) -> list[str]:
    return re.findall(r"(/[^\s'\"]+)", text or "")


@pytest.mark.parametrize("secret", ["/etc/hostname", "/proc/self/environ"])
def test_a_server_file_given_as_an_upload_is_refused_and_never_copied(server, secret):
    with ui_client(server) as client:
        kind, payload = call(client, "generate", generate_inputs(task="fl2va", image=file_data(secret)))
        assert kind == "error"
        text = json.dumps(payload)
        # nothing the message names (and no file Gradio holds) can be fetched through the UI
        for path in named_paths(text):
            assert client.get(f"/ui/gradio_api/file={path}").status_code in (403, 404), path
        copies = [p for p in server.gradio_tmp.rglob("*") if p.is_file() and p.name == secret.rsplit("/", 1)[1]]
        assert copies == []


def test_the_results_folder_is_not_served(server):
    with server.client() as rest:
        job_id = rest.post("/v1/videos", json={"prompt": "a dog", "num_inference_steps": 2, "seed": 3}).json()["id"]
        assert wait_for(rest, job_id)["status"] == "completed"
    with ui_client(server) as client:
        for path in [server.results_dir / "jobs.sqlite3", server.results_dir / f"{job_id}.mp4", server.results_dir]:
            for url in (f"/ui/gradio_api/file={path}", f"/ui/file={path}", f"/ui/gradio_api/file/{path}"):
                assert client.get(url).status_code in (403, 404), url


def test_the_ui_shows_its_own_result_and_forgets_it_when_the_job_is_deleted(server):
    with ui_client(server) as client:
        kind, payload = call(client, "generate", generate_inputs())
        assert kind == "complete", payload
        html = next(value for value in payload if isinstance(value, str) and "<video" in value)
        src = re.search(r'src="([^"]+)"', html).group(1)
        job_id = re.search(r"([0-9a-f]{32})\.mp4", src).group(1)
        url = f"/ui/{src}" if not src.startswith("/") else src
        video = client.get(url)
        assert video.status_code == 200 and video.headers["content-type"] == "video/mp4"
        assert video.content[4:8] == b"ftyp"
        assert video.headers["x-content-type-options"] == "nosniff"
        # no second copy of the result anywhere Gradio keeps files
        assert [p for p in server.gradio_tmp.rglob(f"*{job_id}*")] == []
        # without the UI's login cookie the same URL is refused
        assert httpx.get(server.url + url).status_code in (401, 403)
        # another job's id, or a name that is not a job id, is not found
        assert client.get(url.replace(job_id, "0" * 32)).status_code == 404
        assert client.get(url.replace(f"{job_id}.mp4", "jobs.sqlite3")).status_code == 404
        with server.client() as rest:
            assert rest.delete(f"/v1/videos/{job_id}").status_code == 200
        assert client.get(url).status_code == 404


def test_user_content_is_never_html_and_ui_responses_carry_a_strict_policy(server, tmp_path):
    page = tmp_path / "x.html"
    page.write_text("<script>alert(document.cookie)</script>")
    with ui_client(server) as client:
        root = client.get("/ui/")
        assert root.status_code == 200
        assert root.headers["x-content-type-options"] == "nosniff"
        policy = root.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'self'" in policy
        uploaded = client.post("/ui/gradio_api/upload", files={"files": ("x.html", page.read_bytes(), "text/html")})
        assert uploaded.status_code == 200, uploaded.text
        (path,) = uploaded.json()
        served = client.get(f"/ui/gradio_api/file={path}")
        assert served.status_code == 200
        assert not served.headers["content-type"].startswith("text/html")
        assert served.headers["x-content-type-options"] == "nosniff"
        assert "sandbox" in served.headers["content-security-policy"]


def test_an_upload_is_staged_under_its_decoded_type_not_its_name(tmp_path):
    from helpers.media_files import tone, write_audio
    from PIL import Image

    from h3gen.errors import RequestError
    from h3gen.ui.uploads import stage_uploads

    uploads, staging = tmp_path / "gradio", tmp_path / "staging"
    (uploads / "abc").mkdir(parents=True)
    staging.mkdir()
    Image.new("RGB", (64, 32), (200, 30, 30)).save(uploads / "abc" / "evil.html", format="PNG")
    Image.new("RGB", (64, 32), (20, 30, 200)).save(uploads / "abc" / "face.svg", format="JPEG")
    write_audio(tmp_path / "voice.m4a", tone(1.0, 48000), 48000).rename(uploads / "abc" / "voice.html")
    staged = stage_uploads(
        str(uploads / "abc" / "evil.html"),
        None,
        [str(uploads / "abc" / "face.svg"), str(uploads / "abc" / "voice.html")],
        staging,
        uploads,
    )
    assert {name: path.name for name, path in staged.items()} == {
        "image": "image.png",
        "ref_image_0": "ref_image_0.jpg",
        "ref_audio_1": "ref_audio_1.m4a",
    }
    assert sorted(p.name for p in staging.iterdir()) == ["image.png", "ref_audio_1.m4a", "ref_image_0.jpg"]

    (uploads / "abc" / "page.png").write_text("<script>alert(1)</script>")
    with pytest.raises(RequestError, match="image: the file is not an image") as error:
        stage_uploads(str(uploads / "abc" / "page.png"), None, None, staging, uploads)
    assert str(uploads) not in str(error.value)  # the message never names a server path
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    with pytest.raises(RequestError, match="not uploaded through this page"):
        stage_uploads(str(outside), None, None, staging, uploads)
    with pytest.raises(RequestError, match="not uploaded through this page"):
        stage_uploads(str(uploads / "abc" / ".." / ".." / "secret.png"), None, None, staging, uploads)


def test_uploads_obey_the_upload_limit_and_answers_name_no_server_path(server, tmp_path):
    """--max-upload-mb (1 here) holds for the UI's uploads as for the REST API's, and neither the upload's answer
    nor the events of a job made from it name the folder Gradio keeps uploads in."""
    from PIL import Image

    image = tmp_path / "first.png"
    Image.new("RGB", (96, 64), (200, 20, 20)).save(image)
    with ui_client(server) as client:
        too_big = client.post("/ui/gradio_api/upload", files={"files": ("big.png", b"\0" * (2 * 2**20), "image/png")})
        assert too_big.status_code == 413, too_big.text
        uploaded = client.post("/ui/gradio_api/upload", files={"files": ("first.png", image.read_bytes(), "image/png")})
        assert uploaded.status_code == 200, uploaded.text
        assert str(server.gradio_tmp) not in uploaded.text and str(server.gradio_tmp.resolve()) not in uploaded.text
        (path,) = uploaded.json()
        assert not path.startswith(str(server.gradio_tmp.resolve().parent))
        assert client.get(f"/ui/gradio_api/file={path}").content == image.read_bytes()
        kind, payload = call(client, "generate", generate_inputs(task="fl2va", image=file_data(path), steps=2))
        assert kind == "complete", payload
        assert str(server.gradio_tmp.resolve()) not in json.dumps(payload)


def test_a_small_image_with_a_huge_canvas_is_refused_from_its_header_in_the_ui(server, tmp_path):
    from helpers.media_files import bomb_png

    bomb = bomb_png(tmp_path / "bomb.png")  # 13,000 x 13,000 pixels in about 160 KB
    peak = memory_kb(server.process.pid, "VmHWM")
    with ui_client(server) as client:
        uploaded = client.post("/ui/gradio_api/upload", files={"files": ("bomb.png", bomb.read_bytes(), "image/png")})
        assert uploaded.status_code == 200, uploaded.text
        (path,) = uploaded.json()
        kind, payload = call(client, "generate", generate_inputs(task="fl2va", image=file_data(path)))
        assert "at most 40 MP" in json.dumps(payload), (kind, payload)
    assert memory_kb(server.process.pid, "VmHWM") - peak < 100 * 1024  # decoding it would take 170-500 MB
