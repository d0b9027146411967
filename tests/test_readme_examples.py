"""The examples of the README and of the docs pages run as written.

The examples are the fenced blocks of README.md and docs/*.md (`PAGES`); a command printed on several pages counts
once. The shell blocks that use the tiny demo model (no `--model`) run exactly as printed. The blocks that name the
released checkpoint (`--model /models/MiniMax-H3`) run with the tiny checkpoint's folder in its place and small input
files under the names they use (bud.png, singer.png, voice.m4a, ...); the ref2va curl block (docs/rest-api.md) runs
against a tiny server with its address and key put in. Examples that need what a CPU test machine has not, and the
test that checks each:

- `--tp 2 --ulysses 4`: tests/test_cli.py::test_generate_with_ulysses_under_torchrun_matches_one_process (2 ranks).
- `--lora minimax_h3_fl2v_turbo_...`, `--lora style.safetensors:0.7 ...`: tests/test_cli_loras.py.
- `--offload layerwise --gpu-memory 30GiB`: tests/test_offload.py (the CLI refuses it without a GPU).
- `h3gen plan` / `--planner`: tests/test_k3_engine_planner.py; `h3gen serve ...`: tests/test_server.py.
- The OpenAI SDK block: tests/test_openai_api.py; `H3Client(...)`: tests/test_server.py.
- `benchmarks/bench_pipeline.py` needs a GPU (benchmarks/RESULTS.md).
"""

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers.media_files import moving_frames, tone, write_audio, write_video
from helpers.server_harness import Server, run_isolated, wait_for
from PIL import Image

from h3gen.media import probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the README's examples come first
RELEASED = "/models/MiniMax-H3"
KEY = "readme-key"


def blocks(language: str) -> list[str]:
    """The fenced blocks of `language` of every page, as written, the README's first."""
    return [
        block
        for page in PAGES
        for block in re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    ]


def commands(prefix: str) -> list[str]:
    """Every shell command of the pages that starts with `prefix`, continuation lines joined, comments dropped; a
    command printed on several pages once."""
    found = []
    for block in blocks("bash"):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("   #", 1)[0].strip()
            if command.startswith(prefix):
                found.append(command)
    return list(dict.fromkeys(found))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("h3gen-cache")
    tiny_checkpoint(cache_dir=folder)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder holding the input files the examples name."""
    folder = tmp_path_factory.mktemp("readme-inputs")
    for name, colour in (
        ("bud.png", (40, 120, 40)),
        ("bloom.png", (200, 60, 120)),
        ("singer.png", (90, 90, 200)),
        ("start.png", (10, 10, 10)),
    ):
        Image.new("RGB", (96, 64), colour).save(folder / name)
    write_audio(folder / "voice.m4a", tone(2.0, 44100), 44100)
    write_video(
        folder / "dance.mp4", (moving_frames(36, 64, 64) * 255).astype(np.uint8), 24, audio=tone(1.5, 32000), rate=32000
    )
    return folder


def _run(command: str, cwd: Path, cache: Path, timeout: float = 300):
    env = dict(os.environ, H3GEN_CACHE=str(cache), HF_HUB_OFFLINE="1")
    words = shlex.split(command)
    assert words[0] == "h3gen"
    return run_isolated([sys.executable, "-m", "h3gen.cli", *words[1:]], cwd=cwd, env=env, timeout=timeout)


def test_quick_start_runs_as_written(cache, tmp_path):
    """`h3gen generate "a cat playing the piano in a jazz bar" --out demo.mp4` (the tiny demo model)."""
    quick = [c for c in commands("pip install -e . && h3gen generate")]
    assert len(quick) == 1
    result = _run(quick[0].split("&&", 1)[1].strip(), tmp_path, cache)
    assert result.returncode == 0, result.stderr[-3000:]
    info = probe_mp4(tmp_path / "demo.mp4")
    assert info.num_frames == 124 and info.audio_channels == 2
    assert "wrote demo.mp4" in result.stderr


def test_cli_examples_on_the_released_layout_run_on_the_tiny_one(cache, inputs, tmp_path):
    """The first clip's fox and bloom commands (README.md, docs/cli.md) and the ref2va command (docs/cli.md), with
    the tiny checkpoint for the released one."""
    wanted = ("a red fox runs through fresh snow", "the flower opens", "<Picture 1> sings")
    chosen = [c for c in commands("h3gen generate") if RELEASED in c and any(w in c for w in wanted)]
    assert len(chosen) == 3, chosen
    for file in inputs.iterdir():
        shutil.copy(file, tmp_path / file.name)
    model = str(tiny_checkpoint(cache_dir=cache))
    for command in chosen:
        command = command.replace(RELEASED, model)
        if "--steps 50" in command:
            command = command.replace("--steps 50", "--steps 4")  # the same flags; fewer forwards for the CPU
        result = _run(command, tmp_path, cache)
        assert result.returncode == 0, (command, result.stderr[-3000:])
        out = shlex.split(command)[shlex.split(command).index("--out") + 1]
        assert probe_mp4(tmp_path / out).audio_channels == 2


@pytest.mark.slow
def test_long_clip_example_runs_as_written(cache, tmp_path):
    """The 40 s clip over four windows with a prompt per window (docs/cli.md; the tiny demo model)."""
    (command,) = [c for c in commands("h3gen generate") if "--seconds 40" in c]
    result = _run(command, tmp_path, cache, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    info = probe_mp4(tmp_path / "fox.mp4")
    assert 40.0 <= info.video_seconds <= 40.0 + 17 / 24
    assert "4 windows" in result.stderr


def test_python_quick_start_block_runs_on_the_tiny_model(cache, tmp_path):
    """The README's Python block (docs/python-api.md repeats it), with `h3gen.tiny_checkpoint()` where it names the
    released folder (as its comment says)."""
    block = next(b for b in blocks("python") if 'H3Pipeline.from_pretrained("/models/MiniMax-H3")' in b)
    code = block.replace(f'"{RELEASED}"', "h3gen.tiny_checkpoint()")
    code += "\nassert out.video.shape[0] == 124 and out.audio.shape[0] == 2\nprint('ok')\n"
    env = dict(os.environ, H3GEN_CACHE=str(cache), HF_HUB_OFFLINE="1")
    result = run_isolated([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok") and probe_mp4(tmp_path / "fox.mp4").sample_rate == 48000


def test_ref2va_curl_example_sends_the_prompt_as_text(cache, inputs, tmp_path):
    """The curl command of docs/rest-api.md (`--form-string` for the prompt, whose `<` curl would read as a file)
    against a tiny server."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    (command,) = [c for c in commands("curl") if "task=ref2va" in c]
    with Server(tiny_checkpoint(cache_dir=cache), tmp_path / "results", api_key=KEY) as server:
        command = command.replace("http://127.0.0.1:8000", server.url).replace("$KEY", KEY)
        result = run_isolated(shlex.split(command), cwd=inputs, timeout=120)
        assert result.returncode == 0, result.stderr
        job = httpx.Response(202, content=result.stdout).json()
        assert job["status"] in ("queued", "in_progress"), result.stdout
        with server.client() as http:
            assert http.get(f"/v1/videos/{job['id']}").json()["prompt"] == "<Picture 1> sings <Audio 1>"
            http.delete(f"/v1/videos/{job['id']}")
            wait_for(http, job["id"], statuses=("failed", "completed"), timeout=300)
