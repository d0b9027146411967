"""The `h3gen generate` command: the tiny demo by default, progress, an MP4 that decodes, one-line errors."""

import os
import shutil
import sys

import pytest
from helpers.server_harness import run_isolated

from h3gen.media import probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("h3gen-cache")
    tiny_checkpoint(cache_dir=folder)  # build once for every subprocess below
    return folder


def _h3gen(args, cache, timeout=120):
    env = dict(os.environ, H3GEN_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return run_isolated([sys.executable, "-m", "h3gen.cli", *args], timeout=timeout, env=env)


def test_generate_with_the_tiny_default_writes_a_verified_mp4(cache, tmp_path):
    out = tmp_path / "demo.mp4"
    result = _h3gen(
        ["generate", "a cat playing piano", "--seed", "3", "--steps", "6", "--audio-rate", "48000", "--out", str(out)],
        cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "random" in result.stderr and "noise" in result.stderr  # says plainly the demo weights are random
    assert "denoise" in result.stderr and "100%" in result.stderr  # the progress bar ran to the end
    info = probe_mp4(out)
    assert info.num_frames == 124 and info.fps == 24 and info.audio_channels == 2 and info.sample_rate == 48000


def test_generate_writes_previews_to_a_file_and_names_them_on_its_last_line(cache, tmp_path):
    from PIL import Image

    preview, out = tmp_path / "preview.jpg", tmp_path / "p.mp4"
    flags = ["--seed", "3", "--steps", "7", "--preview", str(preview), "--preview-every", "2", "--out", str(out)]
    result = _h3gen(["generate", "a cat", *flags], cache)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "6 transformer forwards (7 sigma points)" in last and ", 2 previews (" in last, last
    files = sorted(path.name for path in tmp_path.iterdir())
    assert Image.open(preview).size == (128, 64) and files == ["p.mp4", "preview.jpg"]  # no partial file left
    refused = _h3gen(["generate", "a cat", "--preview-every", "2", "--out", str(out)], cache)
    assert refused.returncode != 0 and "--preview-every needs --preview FILE" in refused.stderr


def test_generate_fl2va_from_a_keyframe_file(cache, tmp_path):
    from PIL import Image

    image = tmp_path / "key.png"
    Image.new("RGB", (90, 50), (200, 30, 30)).save(image)
    out = tmp_path / "fl.mp4"
    result = _h3gen(
        [
            "generate",
            "a sunset",
            "--image",
            str(image),
            "--steps",
            "3",
            "--seconds",
            "6",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--quality",
            "exact",
            "--out",
            str(out),
        ],
        cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = probe_mp4(out)
    assert info.num_frames == 158 and (info.width, info.height) == (128, 64)


def _bad_inputs(tmp_path, cache):
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    truncated = tmp_path / "cut.png"
    from PIL import Image

    Image.new("RGB", (64, 64), (1, 2, 3)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_checkpoint(cache_dir=cache), broken)
    shutil.rmtree(broken / "vae")
    return {
        "aspect 1:5": (["--aspect", "1:5"], "aspect"),
        "2 seconds": (["--seconds", "2"], "seconds must be from 5 to 60"),
        "61 seconds": (["--seconds", "61"], "seconds must be from 5 to 60"),
        "301 max seconds": (["--seconds", "30", "--max-seconds", "301"], "max_seconds must be from 15 to 300"),
        "prompts per window": (
            ["--seconds", "30", "--prompt-per-window", "a", "--prompt-per-window", "b"],
            "this request has 3 windows",
        ),
        "window off the grid": (
            ["--seconds", "30", "--window-frames", "250"],
            "window_frames must be a frame count on the 17n+5 grid",
        ),
        "overlap as long as the window": (
            ["--seconds", "30", "--window-frames", "277", "--overlap-frames", "277"],
            "overlap_frames must be shorter than window_frames",
        ),
        "text file as image": (["--image", str(text)], "is not a readable image"),
        "truncated image": (["--image", str(truncated)], "is not a readable image"),
        "missing image": (["--image", str(tmp_path / "nope.png")], "does not exist"),
        "missing component": (["--model", str(broken)], "no vae/ component folder"),
        "missing model folder": (["--model", str(tmp_path / "nowhere")], "does not exist"),
    }


def test_bad_inputs_give_one_line_errors(cache, tmp_path):
    for name, (extra, message) in _bad_inputs(tmp_path, cache).items():
        result = _h3gen(["generate", "a prompt", "--out", str(tmp_path / "x.mp4"), *extra], cache)
        lines = [line for line in result.stderr.splitlines() if line.startswith("h3gen: error:")]
        assert result.returncode != 0, name
        assert "Traceback" not in result.stderr, (name, result.stderr)
        assert len(lines) == 1 and message in lines[0], (name, result.stderr)
        assert not (tmp_path / "x.mp4").exists()


def _decoded(path):
    import av
    import numpy as np

    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=-1)
    return frames.astype(int), audio


def test_generate_with_ulysses_under_torchrun_matches_one_process(cache, tmp_path):
    import numpy as np

    common = ["generate", "a cat on a piano", "--steps", "3", "--seed", "4"]
    single = _h3gen([*common, "--out", str(tmp_path / "one.mp4")], cache)
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = _h3gen([*common, "--ulysses", "2", "--out", str(tmp_path / "two.mp4")], cache, timeout=240)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    frames_one, audio_one = _decoded(tmp_path / "one.mp4")
    frames_two, audio_two = _decoded(tmp_path / "two.mp4")
    # The two runs' frames differ in the last float32 bits (another reduction order); after H.264 at CRF 18 that moves
    # a few pixels by a few levels, while a real divergence of these noise frames moves every pixel by dozens.
    difference = np.abs(frames_one.astype(np.int16) - frames_two.astype(np.int16))
    assert frames_one.shape == frames_two.shape and difference.mean() <= 0.05 and difference.max() <= 16
    assert np.abs(audio_one - audio_two).max() <= 1e-3


def test_invalid_parallel_degrees_fail_before_starting_processes(cache, tmp_path):
    result = _h3gen(["generate", "x", "--tp", "3", "--out", str(tmp_path / "x.mp4")], cache)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "Valid here" in result.stderr and "torch.distributed" not in result.stderr


def test_reference_flags_keep_the_command_line_order():
    from h3gen.cli import build_parser
    from h3gen.cli.arguments import references_of_args

    args = build_parser().parse_args(
        [
            "generate",
            "x",
            "--out",
            "o.mp4",
            "--ref-audio",
            "a.wav",
            "--ref-image",
            "b.png",
            "--ref-video",
            "c.mp4",
            "--ref-image",
            "d.png",
        ]
    )
    references = references_of_args(args)
    assert [(r.kind, str(getattr(r, r.kind)), r.name) for r in references] == [
        ("audio", "a.wav", "--ref-audio"),
        ("image", "b.png", "--ref-image"),
        ("video", "c.mp4", "--ref-video"),
        ("image", "d.png", "--ref-image"),
    ]
    assert references_of_args(build_parser().parse_args(["generate", "x", "--out", "o.mp4"])) is None


def test_generate_ref2va_takes_its_length_from_the_reference_sound(cache, tmp_path):
    from helpers.media_files import moving_frames, tone, write_audio, write_video
    from PIL import Image

    Image.new("RGB", (60, 90), (20, 120, 220)).save(tmp_path / "face.png")
    write_audio(tmp_path / "voice.m4a", tone(6.1, 48000), 48000)
    write_video(tmp_path / "dance.mp4", moving_frames(30, 48, 64), 24)
    out = tmp_path / "ref.mp4"
    result = _h3gen(
        [
            "generate",
            "she sings",
            "--ref-image",
            str(tmp_path / "face.png"),
            "--ref-audio",
            str(tmp_path / "voice.m4a"),
            "--ref-video",
            str(tmp_path / "dance.mp4"),
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = probe_mp4(out)
    assert info.num_frames == 158 and (info.width, info.height) == (128, 64)  # 6.1 s -> 146 -> 17n+5 = 158


def test_bad_references_give_one_line_errors(cache, tmp_path):
    from helpers.media_files import tone, write_audio

    write_audio(tmp_path / "voice.wav", tone(1.0, 32000), 32000)
    (tmp_path / "notes.txt").write_text("not a video")
    for extra, message in (
        (["--ref-audio", str(tmp_path / "voice.wav")], "--ref-audio"),
        (["--ref-video", str(tmp_path / "notes.txt")], "--ref-video file"),
    ):
        result = _h3gen(["generate", "x", "--out", str(tmp_path / "x.mp4"), *extra], cache)
        lines = [line for line in result.stderr.splitlines() if line.startswith("h3gen: error:")]
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert len(lines) == 1 and message in lines[0], result.stderr


def test_serve_help_gives_every_flag_a_help_text_and_its_default():
    import argparse

    from h3gen.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    text = serve.format_help()
    options = text.split("options:", 1)[1]
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help, flag
        block = options.split(f"\n  {flag}", 1)[1].split("\n  -", 1)[0]  # the flag's entry in the help page
        assert "default" in " ".join(block.split()), (flag, block)
    assert "(default: 8000)" in text and "(default: h3gen-results)" in text


def test_serve_without_ui_mounts_no_ui(cache, tmp_path):
    from helpers.server_harness import Server

    server = Server(tiny_checkpoint(cache_dir=cache), tmp_path / "results", ui=False)
    try:
        import httpx

        assert httpx.get(f"{server.url}/ui/").status_code == 404
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
    import ast

    from h3gen.server import app as server_app

    tree = ast.parse(open(server_app.__file__).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [name for name in imported if name.startswith(("gradio", "h3gen.ui"))]  # the server never imports the UI
