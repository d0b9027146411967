"""What the CLI writes, without a model: `generate`'s last line, `plan`'s text, the progress bars' names and
`--preview`'s file."""

import argparse
import io
from types import SimpleNamespace

import numpy as np
from PIL import Image

from h3gen.cli.generate import summary_line
from h3gen.cli.plan import printable, run_plan
from h3gen.cli.progress import progress_bar, window_bar, with_previews
from h3gen.media import MediaInfo
from h3gen.pipelines.h3 import H3Output, Preview

MEDIA = MediaInfo(124, 1344, 768, 24.0, 5.17, 2, 32000, 5.17)
SAMPLING = dict(num_inference_steps=9, forwards=8, video_shift=6.0, audio_shift=3.0, recipe="LightX2V Turbo")


def test_last_line_names_adapters_recipe_forwards_cached_and_previews():
    output = H3Output(
        None,
        None,
        seed=7,
        media=MEDIA,
        num_forwards=8,
        cached_steps=[2, 5],
        loras=[("turbo", 0.8), ("style", 1.0)],
        sampling=SAMPLING,
        previews=3,
        preview_seconds=0.42,
    )
    line = summary_line("out.mp4", output, "high")
    assert line.startswith("h3gen: wrote out.mp4: 124 frames 1344x768 at 24 fps, stereo AAC 32000 Hz, 5.17 s, seed 7;")
    assert "8 transformer forwards (9 sigma points), shifts 6/3, recipe LightX2V Turbo" in line
    assert "LoRA turbo x0.8, style x1" in line
    assert "2 of 8 forwards cached (steps 2,5)" in line and line.endswith("3 previews (0.42 s)")


def test_last_line_of_a_long_clip_counts_every_windows_forwards():
    media = MediaInfo(720, 128, 64, 24.0, 30.0, 2, 32000, 30.0)
    sampling = dict(SAMPLING, recipe=None)
    output = H3Output(None, None, seed=1, media=media, windows=3, num_forwards=24, sampling=sampling)
    line = summary_line("long.mp4", output, "lossless")
    assert "at 24 fps in 3 windows" in line
    assert "24 transformer forwards (8 per window, 9 sigma points each), shifts 6/3" in line
    assert "recipe" not in line and "LoRA" not in line and "cached" not in line and "previews" not in line


def test_plan_prints_valid_text_whatever_the_model_writes(monkeypatch, capsysbinary):
    raw = "a cat\udcff\ud800 sings\x1b[2J\x07 caf\u00e9\n\tend"

    class Planner:
        def plan(self, prompt, image=None, max_tokens=None, seed=None, temperature=None, on_text=None):
            if on_text is not None:
                on_text(raw[:7])
                on_text(raw[7:])
            return SimpleNamespace(planned=raw, backend="fake", seconds=0.1, tokens=9)

    monkeypatch.setattr("h3gen.cli.plan.planner_for", lambda *args: Planner())
    for stream in (False, True):
        args = argparse.Namespace(
            prompt="x", image=None, model="tiny", api_key=None, max_tokens=8, seed=0, temperature=None, device=None
        )
        args.stream = stream
        assert run_plan(args) == 0
        written = capsysbinary.readouterr().out
        text = written.decode("utf-8")  # valid UTF-8
        assert "\x1b" not in text and "\x07" not in text
        assert text == "a cat\ufffd\ufffd sings\ufffd[2J\ufffd caf\u00e9\n\tend\n"
    assert printable("plain text\n") == "plain text\n"


def test_progress_bars_name_the_stage_and_the_window():
    bar, callback = progress_bar({"encode_text": 1, "denoise": 4, "decode_video": 1})
    callback("encode_text", 0, 1)
    assert bar.desc.startswith("encode_text")
    callback("denoise", 2, 4)
    assert bar.desc.startswith("denoise")
    callback("decode_video", 0, 1)  # a stage that starts names itself before it moves the bar
    assert bar.desc.startswith("decode_video")
    bar.close()
    bar, callback = window_bar(2, 3)
    callback("window", 1, 2)
    assert bar.desc.startswith("window 2/2")
    callback("denoise", 1, 3)
    assert bar.desc.startswith("window 2/2 denoise")
    callback("decode_video", 0, 1)  # does not move the bar, still named at once
    assert bar.desc.startswith("window 2/2 decode_video")
    bar.close()


def test_preview_file_is_replaced_whole(tmp_path):
    seen = []
    target = tmp_path / "preview.jpg"
    report = with_previews(lambda stage, step, total: seen.append((stage, step, total)), target)
    report("denoise", 1, 4)
    for shade in (10, 200):
        report("preview", 2, 4, Preview(np.full((32, 48, 3), shade, np.uint8), 2, 4))
        picture = np.asarray(Image.open(io.BytesIO(target.read_bytes())))
        assert picture.shape == (32, 48, 3) and abs(int(picture.mean()) - shade) <= 2
    assert seen == [("denoise", 1, 4)] and [path.name for path in tmp_path.iterdir()] == ["preview.jpg"]
