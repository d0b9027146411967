"""`h3gen generate --lora PATH[:SCALE]` and the step-count flags: a Turbo adapter's 8-forward recipe end to end,
and one-line messages for a request that contradicts it."""

import os
import sys

import pytest
from helpers.recipe_files import write_turbo
from helpers.server_harness import run_isolated

from h3gen.cli import build_parser
from h3gen.cli.arguments import lora_argument
from h3gen.media import probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

RECIPE = "LightX2V Turbo fl2v 8-step v1.0 768p"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("h3gen-cache")
    tiny_checkpoint(cache_dir=folder)
    return folder


@pytest.fixture(scope="module")
def turbo(cache, tmp_path_factory):
    return write_turbo(tmp_path_factory.mktemp("loras"), tiny_checkpoint(cache_dir=cache))


def _h3gen(args, cache, timeout=300):
    env = dict(os.environ, H3GEN_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return run_isolated([sys.executable, "-m", "h3gen.cli", *args], timeout=timeout, env=env)


def test_lora_flag_takes_a_path_and_an_optional_scale():
    assert lora_argument("a.safetensors") == ("a.safetensors", 1.0)
    assert lora_argument("a.safetensors:0.7") == ("a.safetensors", 0.7)
    assert lora_argument("dir:with:colons/a.safetensors:-0.5") == ("dir:with:colons/a.safetensors", -0.5)
    assert lora_argument("c:/x/a.safetensors") == ("c:/x/a.safetensors", 1.0)
    args = build_parser().parse_args(
        ["generate", "x", "--out", "o.mp4", "--lora", "a.safetensors:0.7", "--lora", "b.safetensors", "--forwards", "8"]
    )
    assert args.lora == [("a.safetensors", 0.7), ("b.safetensors", 1.0)] and args.forwards == 8


def test_a_turbo_lora_runs_its_eight_forwards_end_to_end(cache, turbo, tmp_path):
    out = tmp_path / "turbo.mp4"
    result = _h3gen(["generate", "a fox", "--seed", "2", "--lora", f"{turbo}:0.8", "--out", str(out)], cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"8 transformer forwards (9 sigma points), shifts 6/3, recipe {RECIPE}, LoRA {turbo.stem} x0.8" in result.stderr
    )
    assert probe_mp4(out).num_frames == 124


def test_forwards_flag_counts_forwards(cache, tmp_path):
    result = _h3gen(["generate", "a fox", "--seed", "2", "--forwards", "2", "--out", str(tmp_path / "f.mp4")], cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 transformer forwards (3 sigma points), shifts 12/3" in result.stderr


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--steps", "20"], "num_inference_steps=20 (19 forwards)"),
        (["--forwards", "4"], "forwards=4"),
        (["--video-shift", "12"], "video_shift 6"),
        (["--steps", "9", "--forwards", "8"], "not both"),
    ],
)
def test_a_contradiction_is_one_line_naming_the_recipe_before_loading(cache, turbo, tmp_path, flags, words):
    result = _h3gen(["generate", "a fox", "--lora", str(turbo), *flags, "--out", str(tmp_path / "x.mp4")], cache)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "loading" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("h3gen: error:")]
    assert len(lines) == 1 and words in lines[0]
    assert RECIPE in lines[0] or words == "not both"


def test_a_missing_lora_file_is_named(cache, tmp_path):
    result = _h3gen(
        ["generate", "x", "--lora", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "x.mp4")], cache
    )
    assert result.returncode == 2 and "nope.safetensors does not exist" in result.stderr


def test_an_invalid_lora_gpu_memory_stops_serve_at_startup(cache, tmp_path):
    result = _h3gen(
        [
            "serve",
            "--lora-gpu-memory",
            "lots",
            "--no-ui",
            "--device",
            "cpu",
            "--results-dir",
            str(tmp_path / "results"),
        ],
        cache,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("h3gen: error:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert lines == [
        "h3gen: error: --lora-gpu-memory must be a size like 4GiB, 2GB or 512MiB, 0 or more (got 'lots')."
    ], result.stderr
