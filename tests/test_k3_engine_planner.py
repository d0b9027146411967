"""The prompt planner end to end (mechanics, not quality): the tiny K3 plans and its text drives the H3 pipeline;
the OpenAI-compatible remote planner against a stub server; `h3gen plan`; `POST /v1/prompts/plan` and `plan: true`
jobs with the planned prompt in the job status."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from h3gen.errors import RequestError
from h3gen.pipelines.k3.demo_model import build_tiny_checkpoint
from h3gen.pipelines.k3.planner import SYSTEM_PROMPT, LocalPlanner, PlannerError, RemotePlanner


class _Stub(BaseHTTPRequestHandler):
    """`POST /v1/chat/completions`: answers "PLAN(<n>): <user text>" (n = calls so far); "fail" -> HTTP 500,
    "garbage" -> not JSON, "empty" -> no text."""

    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((self.path, dict(self.headers), body))
        content = body["messages"][-1]["content"]
        text = content if isinstance(content, str) else next(p["text"] for p in content if p["type"] == "text")
        if text == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model exploded")
            return
        payload = (
            b"<html>"
            if text == "garbage"
            else json.dumps(
                {
                    "choices": [
                        {
                            "message": {
                                "role": "assistant",
                                "content": "" if text == "empty" else f"PLAN({len(self.seen)}): {text}",
                            }
                        }
                    ],
                    "usage": {"completion_tokens": 7},
                }
            ).encode()
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second OpenMP thread only stalls on a shared, busy CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-k3"), seed=0)


@pytest.fixture(scope="module")
def h3_model(tmp_path_factory):
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


def test_remote_planner_speaks_openai_chat_completions(stub, tmp_path):
    planner = RemotePlanner(stub, model="k3-test", api_key="secret")
    result = planner.plan("a fox in snow", max_tokens=99, seed=4)
    assert result.planned.endswith("): a fox in snow") and result.tokens == 7
    path, headers, body = _Stub.seen[-1]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer secret"
    assert body["model"] == "k3-test" and body["max_tokens"] == 99 and body["seed"] == 4
    assert body["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    image = tmp_path / "start.png"
    Image.new("RGB", (8, 6), (200, 10, 10)).save(image)
    planner.plan("it starts here", image=image)
    parts = _Stub.seen[-1][2]["messages"][-1]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    for text, message in (
        ("fail", "HTTP 500: model exploded"),
        ("garbage", "did not answer JSON"),
        ("empty", "returned no text"),
    ):
        with pytest.raises(PlannerError, match=message):
            planner.plan(text)
    with pytest.raises(PlannerError, match="unreachable"):
        RemotePlanner("http://127.0.0.1:9/v1", timeout=5).plan("x")
    with pytest.raises(RequestError, match="max_tokens"):
        planner.plan("x", max_tokens=0)


def test_tiny_k3_plans_and_the_plan_drives_the_h3_pipeline(tiny_k3, h3_model):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    planner = LocalPlanner.from_pretrained(tiny_k3, device="cpu", dtype=torch.float32, max_context=2048, chunk_size=128)
    alone = planner.plan("a fox runs through snow", max_tokens=24, seed=11)
    assert alone.planned and 0 < alone.tokens <= 24 and alone.backend.startswith("local:")
    # The chat prompt holds the system prompt and the user's idea, in K3's chat format, with no thinking block.
    ids = planner.prompt_ids("a fox runs through snow")
    text = planner.tokenizer.decode(ids)
    assert SYSTEM_PROMPT in text and "a fox runs through snow" in text and text.endswith("response<|sep|>")
    # Two plans at once are batched; the shared system prompt comes from the prefix cache the first plan left.
    cached = planner.engine.stats["cached_tokens"]
    results = [None, None]
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(i, planner.plan("a fox runs through snow", max_tokens=24, seed=11))
        )
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [r.planned for r in results] == [alone.planned] * 2
    assert planner.engine.stats["cached_tokens"] - cached >= 2 * 128
    with pytest.raises(RequestError, match="does not exist"):  # the image path is checked before any work
        planner.plan("x", image="no-such-start.png")

    pipe = H3Pipeline.from_pretrained(h3_model, device="cpu", torch_dtype=torch.float32, planner=planner)
    encoded = []
    encode = pipe.text_encoder.encode
    pipe.text_encoder.encode = lambda prompt, *rest: encoded.append(prompt) or encode(prompt, *rest)
    stages = []
    output = pipe(
        "a fox runs through snow",
        plan=True,
        plan_max_tokens=24,
        seed=11,
        num_inference_steps=2,
        decode=False,
        callback=lambda stage, step, total: stages.append(stage),
    )
    assert output.planned_prompt == alone.planned and encoded == [alone.planned] and stages[0] == "plan"
    plain = H3Pipeline.from_pretrained(h3_model, device="cpu", torch_dtype=torch.float32)
    with pytest.raises(RequestError, match="planner"):
        plain("x", plan=True, num_inference_steps=2)


def test_cli_plan_prints_the_planned_prompt(stub, capsys):
    from h3gen.cli import main

    assert main(["plan", "waves at night", "--model", stub, "--max-tokens", "50"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("): waves at night") and "planned by remote:" in err
    assert _Stub.seen[-1][2]["max_tokens"] == 50
    assert main(["plan", "fail", "--model", stub]) == 2
    assert "HTTP 500" in capsys.readouterr().err
    assert main(["plan", "x", "--model", stub, "--image", "/no/such.png"]) == 2
    capsys.readouterr()
    assert main(["plan", "waves at dawn", "--model", stub, "--stream"]) == 0
    assert capsys.readouterr().out.strip().endswith("): waves at dawn")


def test_rest_plan_endpoint_and_plan_true_jobs(stub, h3_model, tmp_path):
    from fastapi.testclient import TestClient

    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager

    engine = H3Engine(h3_model, device="cpu", planner=RemotePlanner(stub))
    with TestClient(create_app(JobManager(engine, tmp_path / "results"))) as http:
        planned = http.post("/v1/prompts/plan", json={"prompt": "rain on a tin roof", "max_tokens": 40})
        assert planned.status_code == 200, planned.text
        assert planned.json()["planned_prompt"].endswith("): rain on a tin roof")
        assert planned.json()["backend"] == f"remote:{stub}"
        form = http.post("/v1/prompts/plan", files={"prompt": (None, "a bell"), "seed": (None, "3")})
        assert form.status_code == 200 and _Stub.seen[-1][2]["seed"] == 3
        assert http.post("/v1/prompts/plan", json={"prompt": ""}).status_code == 422
        assert http.post("/v1/prompts/plan", json={"prompt": "x", "max_tokens": 0}).status_code == 422
        assert http.post("/v1/prompts/plan", json={"prompt": "x", "bogus": 1}).status_code == 422
        failed = http.post("/v1/prompts/plan", json={"prompt": "fail"})
        assert failed.status_code == 424 and "HTTP 500" in failed.json()["detail"]

        job = http.post("/v1/videos", json={"prompt": "a drum solo", "plan": True, "num_inference_steps": 2})
        assert job.status_code == 202, job.text
        view = _wait(http, job.json()["id"])
        assert view["status"] == "completed", view
        assert view["planned_prompt"].endswith("): a drum solo") and view["request"]["prompt"] == "a drum solo"
        assert "plan" in view["timings"]
        bad = http.post("/v1/videos", json={"prompt": "fail", "plan": True, "num_inference_steps": 2})
        view = _wait(http, bad.json()["id"])
        assert (
            view["status"] == "failed" and "HTTP 500" in view["error"]["message"]
        )  # the job fails, the server goes on
        assert http.get("/health").json()["ready"]

    plain = H3Engine(h3_model, device="cpu")
    with TestClient(create_app(JobManager(plain, tmp_path / "results2"))) as http:
        response = http.post("/v1/videos", json={"prompt": "x", "plan": True})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "plan"]
        response = http.post("/v1/prompts/plan", json={"prompt": "x"})
        assert response.status_code == 409 and "--planner" in response.json()["detail"]


def _wait(http, job_id, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = http.get(f"/v1/videos/{job_id}").json()
        if view["status"] in ("completed", "failed"):
            return view
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish")


def test_local_planner_reads_an_image_through_the_vision_tower(tiny_k3, tmp_path):
    from h3gen.pipelines.k3.engine import SamplingParams

    planner = LocalPlanner.from_pretrained(tiny_k3, device="cpu", dtype=torch.float32, max_context=2048)
    assert planner.accepts_images
    image = tmp_path / "start.png"
    Image.new("RGB", (61, 45), (200, 10, 10)).save(image)
    result = planner.plan("it starts here", image=image, max_tokens=6, seed=1, temperature=0.0)
    assert result.tokens and result.backend.startswith("local:")
    # The engine's greedy tokens for the image prompt equal the model's own, with the image spliced at its
    # <|media_pad|> span; another image changes them.
    processed = planner.process_image(image)
    ids = planner.prompt_ids("it starts here", processed)
    assert ids.count(planner.tokenizer.token_id("<|media_pad|>")) == processed.num_tokens[0] > 0
    params = SamplingParams(max_tokens=6, temperature=0.0)
    (request,) = planner.engine.generate([ids], params, images=[processed])
    with torch.no_grad():
        expected = planner.engine.model.generate(
            torch.tensor([ids]), 6, pixel_values=processed.pixel_values, grid_thws=processed.grid_thws
        )
    assert request.output_ids == expected[0].tolist()
    with torch.no_grad():
        other = planner.engine.model(
            torch.tensor([ids]), pixel_values=torch.rand_like(processed.pixel_values), grid_thws=processed.grid_thws
        )[0, -1]
        same = planner.engine.model(
            torch.tensor([ids]), pixel_values=processed.pixel_values, grid_thws=processed.grid_thws
        )[0, -1]
    assert not torch.allclose(other, same)
    with pytest.raises(RequestError, match="cannot read the image"):
        planner.plan("x", image=b"not an image")


def _events(body: str) -> list[tuple[str, dict]]:
    """Server-sent events -> [(event, data)]."""
    out = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_planned_text_streams_locally_and_over_rest(tiny_k3, stub, h3_model, tmp_path):
    from fastapi.testclient import TestClient

    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager

    planner = LocalPlanner.from_pretrained(tiny_k3, device="cpu")
    pieces = []
    result = planner.plan("waves on rocks", max_tokens=24, seed=5, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces).strip() == result.planned  # the text came piece by piece
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(PlannerError, match="cancelled"):
        planner.plan("waves on rocks", max_tokens=24, cancel=cancel)
    assert not (planner.engine.waiting or planner.engine.running)  # the cancelled request left the engine

    engine = H3Engine(h3_model, device="cpu", planner=planner)
    with TestClient(create_app(JobManager(engine, tmp_path / "results"))) as http:
        plain = http.post("/v1/prompts/plan", json={"prompt": "waves on rocks", "max_tokens": 24, "seed": 5})
        streamed = http.post(
            "/v1/prompts/plan", json={"prompt": "waves on rocks", "max_tokens": 24, "seed": 5, "stream": True}
        )
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        events = _events(streamed.text)
        assert [e for e, _ in events[:-1]] == ["delta"] * (len(events) - 1) and events[-1][0] == "done"
        assert "".join(d["text"] for _, d in events[:-1]).strip() == events[-1][1]["planned_prompt"]
        assert events[-1][1]["planned_prompt"] == plain.json()["planned_prompt"] == result.planned

    remote = H3Engine(h3_model, device="cpu", planner=RemotePlanner(stub))
    with TestClient(create_app(JobManager(remote, tmp_path / "results2"))) as http:
        events = _events(http.post("/v1/prompts/plan", json={"prompt": "a gong", "stream": True}).text)
        assert [e for e, _ in events] == ["delta", "done"] and events[0][1]["text"].endswith(": a gong")
        failed = http.post("/v1/prompts/plan", json={"prompt": "fail", "stream": True})  # fails before any text
        assert failed.status_code == 424 and "HTTP 500" in failed.json()["detail"]
