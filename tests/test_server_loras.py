"""LoRA adapters and step counts over REST, through the real `h3gen serve --lora-dir` (tiny model, 127.0.0.1):
GET /v1/loras, names confined to the folder, recipe contradictions, and jobs that run adapters end to end."""

import io
import json
import os

import httpx
import pytest
from helpers.lora_files import diffusers_shapes, random_factors, write_diffusers
from helpers.recipe_files import TURBO_8_768P, write_turbo
from helpers.server_harness import Server, wait_for
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "lora-key"
TURBO = TURBO_8_768P.removesuffix(".safetensors")
RECIPE = "LightX2V Turbo fl2v 8-step v1.0 768p"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch

    from h3gen.pipelines.h3.transformer import H3Transformer

    root = tmp_path_factory.mktemp("server-loras")
    model = tiny_checkpoint(cache_dir=root / "cache")
    folder = root / "loras"
    folder.mkdir()
    write_turbo(folder, model)
    transformer = H3Transformer.from_pretrained(model / "transformer", torch_dtype=torch.float32)
    write_diffusers(folder / "style.safetensors", random_factors(diffusers_shapes(transformer), 2, 5, scale=0.05))
    outside = root / "outside"
    outside.mkdir()
    write_diffusers(outside / "secret.safetensors", random_factors(diffusers_shapes(transformer), 2, 6, scale=0.05))
    os.symlink(outside / "secret.safetensors", folder / "escape.safetensors")  # a link out of the folder
    (folder / "sub").mkdir()
    write_diffusers(folder / "sub" / "inner.safetensors", random_factors(diffusers_shapes(transformer), 2, 7))
    (folder / "broken.safetensors").write_bytes(b"not a safetensors file")
    server = Server(model, root / "results", api_key=KEY, extra=("--lora-dir", str(folder)))
    yield server, root
    server.stop()


def _no_server_path(text: str, root) -> None:
    assert str(root) not in text and "/tmp" not in text and "loras/" not in text


def test_get_loras_lists_the_folder_behind_the_key(setup):
    server, root = setup
    with server.client() as http:
        assert http.get("/v1/loras", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{server.url}/v1/loras").status_code == 401
        answer = http.get("/v1/loras")
    assert answer.status_code == 200
    _no_server_path(answer.text, root)
    entries = {entry["name"]: entry for entry in answer.json()["data"]}
    assert sorted(entries) == sorted(["broken", "style", TURBO])  # not the link out, not the subfolder's file
    turbo = entries[TURBO]
    assert turbo["size"] == (root / "loras" / TURBO_8_768P).stat().st_size
    assert turbo["format"] == "peft" and turbo["rank"] == 4 and turbo["partition"] == ["transformer"]
    assert turbo["recipe"]["name"] == RECIPE and turbo["recipe"]["forwards"] == 8
    assert turbo["recipe"]["num_inference_steps"] == 9 and turbo["recipe"]["video_shift"] == 6.0
    assert entries["style"]["recipe"] is None and entries["style"]["rank"] == 2
    assert entries["broken"]["error"]


@pytest.mark.parametrize(
    "name",
    [
        "../outside/secret",
        "../outside/secret.safetensors",
        "/etc/hostname",
        "sub/inner",
        "escape",
        "escape.safetensors",
        "nope",
        ".hidden",
        "a\\b",
        "..",
        "style/../style",
    ],
)
def test_names_outside_the_folder_or_unknown_are_refused_naming_the_name(setup, name):
    server, root = setup
    with server.client() as http:
        for send in (
            {"json": {"prompt": "x", "loras": [{"name": name}]}},
            {"files": {"prompt": (None, "x"), "loras": (None, json.dumps([{"name": name, "scale": 0.5}]))}},
        ):
            answer = http.post("/v1/videos", **send)  # JSON, and multipart with the list as a JSON string
            assert answer.status_code == 422, answer.text
            message = answer.json()["detail"][0]["msg"]
            # The name is quoted back (an absolute one as its last part: answers never carry a server path).
            shown = repr(name.rpartition("/")[2] if name.startswith("/") else name)
            assert answer.json()["detail"][0]["loc"] == ["body", "loras"] and shown in message
            assert "GET v1/loras lists them" in message
            _no_server_path(message.replace(shown, ""), root)


def test_too_many_adapters_and_recipe_contradictions_are_422_before_any_job(setup):
    server, root = setup
    with server.client() as http:
        before = http.get("/v1/videos").json()["data"]
        many = http.post("/v1/videos", json={"prompt": "x", "loras": [{"name": "style"}] * 9})
        assert many.status_code == 422 and many.json()["detail"][0]["loc"] == ["body", "loras"]
        twice = http.post("/v1/videos", json={"prompt": "x", "loras": [{"name": "style"}, {"name": "style"}]})
        assert twice.status_code == 422 and "twice" in twice.text
        for body, field in (
            ({"num_inference_steps": 20}, "num_inference_steps"),
            ({"forwards": 4}, "forwards"),
            ({"video_shift": 12}, "video_shift"),
        ):
            answer = http.post("/v1/videos", json={"prompt": "x", "loras": [{"name": TURBO}], **body})
            assert answer.status_code == 422, answer.text
            detail = answer.json()["detail"][0]
            assert detail["loc"] == ["body", field] and RECIPE in detail["msg"]
        # An fl2v Turbo adapter on a ref2va job (a reference image uploaded).
        picture = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 40, 40)).save(picture, format="PNG")
        answer = http.post(
            "/v1/videos",
            files={
                "prompt": (None, "x"),
                "task": (None, "ref2va"),
                "loras": (None, json.dumps([{"name": TURBO}])),
                "ref_image": ("a.png", picture.getvalue(), "image/png"),
            },
        )
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "task"]
        assert RECIPE in answer.text and "not ref2va" in answer.text
        both = http.post("/v1/videos", json={"prompt": "x", "num_inference_steps": 9, "forwards": 8})
        assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["body", "forwards"]
        assert http.get("/v1/videos").json()["data"] == before


def test_a_small_lora_gpu_memory_refuses_adapters_at_submission_and_creates_no_job(setup):
    server, root = setup
    capped = Server(
        tiny_checkpoint(cache_dir=root / "cache"),
        root / "capped-results",
        api_key=KEY,
        extra=("--lora-dir", str(root / "loras"), "--lora-gpu-memory", "1KiB"),
    )
    try:
        with capped.client() as http:
            body = {"prompt": "x", "seed": 1, "loras": [{"name": "style", "scale": 0.5}]}
            answer = http.post("/v1/videos", json=body)
            assert answer.status_code == 422, answer.text
            detail = answer.json()["detail"][0]
            assert detail["loc"] == ["body", "loras"]
            assert "the 1 LoRA adapters (style) need" in detail["msg"] and " KiB on the device" in detail["msg"]
            assert "more than the 1.0 KiB they may use (lora_gpu_memory)" in detail["msg"]
            _no_server_path(answer.text, root)
            assert http.get("/v1/videos").json()["data"] == []  # no job was created
            assert http.post("/v1/videos", json={"prompt": "x", "seed": 1}).status_code == 202  # no adapter: fine
            assert len(http.get("/v1/videos").json()["data"]) == 1
    finally:
        capped.stop()
    with server.client() as http:  # the same request on a server without the cap
        created = http.post("/v1/videos", json=body)
        assert created.status_code == 202, created.text
        http.delete(f"/v1/videos/{created.json()['id']}")


def test_the_cap_holds_before_the_model_has_loaded(setup):
    from h3gen.errors import RequestError
    from h3gen.server.engine import H3Engine
    from h3gen.server.schemas import GenerationBody

    _, root = setup
    engine = H3Engine(
        tiny_checkpoint(cache_dir=root / "cache"), device="cpu", lora_dir=root / "loras", lora_gpu_memory="1KiB"
    )
    assert engine.pipeline is None
    with pytest.raises(RequestError, match=r"the 1 LoRA adapters \(style\) need .* \(lora_gpu_memory\)") as error:
        engine.validate(GenerationBody(prompt="x", loras=[{"name": "style"}]), {})
    assert error.value.field == "loras"
    engine.validate(GenerationBody(prompt="x"), {})


def test_jobs_run_their_adapters_and_report_both_step_counts(setup):
    server, root = setup
    with server.client() as http:
        created = http.post(
            "/v1/videos",
            json={
                "prompt": "a turbo fox",
                "seed": 1,
                "loras": [{"name": TURBO_8_768P}, {"name": "style", "scale": 0.5}],
            },
        )
        assert created.status_code == 202, created.text
        multipart = http.post(
            "/v1/videos",
            files={
                "prompt": (None, "a turbo cat"),
                "seed": (None, "2"),
                "loras": (None, json.dumps([{"name": TURBO, "scale": 0.7}])),
            },
        )
        assert multipart.status_code == 202, multipart.text
        plain = http.post("/v1/videos", json={"prompt": "plain", "seed": 3, "forwards": 2})
        assert plain.status_code == 202, plain.text
        done = [wait_for(http, job.json()["id"], timeout=300) for job in (created, multipart, plain)]
    for view in done:
        assert view["status"] == "completed", view
        _no_server_path(json.dumps(view), root)
    first, second, third = (view["request"] for view in done)
    assert first["loras"] == [{"name": TURBO, "scale": 1.0}, {"name": "style", "scale": 0.5}]
    assert (first["forwards"], first["num_inference_steps"], first["recipe"]) == (8, 9, RECIPE)
    assert (first["video_shift"], first["audio_shift"]) == (6.0, 3.0)
    assert second["loras"] == [{"name": TURBO, "scale": 0.7}] and second["forwards"] == 8
    assert third["loras"] == [] and (third["forwards"], third["num_inference_steps"]) == (2, 3)
    assert third["recipe"] is None and third["video_shift"] == 12.0
    with server.client() as http:
        remixed = http.post(f"/v1/videos/{done[0]['id']}/remix", json={"prompt": "again"})
        assert remixed.status_code == 202, remixed.text
        again = wait_for(http, remixed.json()["id"], timeout=300)
    assert again["status"] == "completed" and again["request"]["loras"] == first["loras"]
    assert again["request"]["forwards"] == 8


def test_the_python_client_sends_loras_with_uploads(setup, tmp_path):
    from h3gen.client import H3Client

    server, root = setup
    picture = tmp_path / "first.png"
    Image.new("RGB", (64, 48), (10, 120, 40)).save(picture)
    with H3Client(server.url, api_key=KEY) as client:
        job = client.create(
            "a keyframe", image=picture, num_inference_steps=2, loras=[{"name": "style", "scale": 0.3}]
        )  # multipart: the list as a JSON text part
        assert job["request"]["loras"] == [{"name": "style", "scale": 0.3}] and job["request"]["task"] == "fl2va"
        client.cancel(job["id"])
