"""Clips longer than 15 s (windowed continuation, `pipelines/h3/continuation.py` and `long_video.py`) on the tiny
model: windows and their checks, the guide's layout, decoding and writing piece by piece, whole requests (length,
first window, seams, memory), and every face's errors."""

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from h3gen.errors import RequestError
from h3gen.media import probe_mp4
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.continuation import audio_boundary, check_windows, long_frames, plan_windows, window_prompts
from h3gen.pipelines.h3.packing import ReferenceBlock, build_layout, build_ref2va_layout
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Clips of 16 to 60 s on the tiny model, some across processes: outside the fast tier.
pytestmark = pytest.mark.slow

CANVAS = dict(height=64, width=64, num_inference_steps=2)


@pytest.fixture(scope="module")
def pipe():
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    pipeline = H3Pipeline.from_pretrained(tiny_checkpoint(), device="cpu", torch_dtype=torch.float32, workflow="all")
    return pipeline


def record_windows(pipeline, monkeypatch, requests: list | None = None) -> list:
    """Every `denoise` stage result from now on (the plain path's and each window's): (video latents, audio latents)
    per window; each window's request goes to `requests` when given."""
    from h3gen.pipelines.h3 import long_video
    from h3gen.pipelines.h3 import pipeline as pipeline_module
    from h3gen.pipelines.h3.stages import denoise as original

    calls = []

    def denoise(transformer, request, *args, **kwargs):
        result = original(transformer, request, *args, **kwargs)
        calls.append((result.video.clone(), result.audio.clone()))
        if requests is not None:
            requests.append(request)
        return result

    for module in (long_video, pipeline_module):
        monkeypatch.setattr(module, "denoise", denoise)
    return calls


# ---------------------------------------------------------------------------------------------- windows and checks


def test_windows_cover_the_clip_on_the_grid():
    windows = plan_windows(1450, 277, 22)  # 60 s
    assert windows[0].start == 0 and windows[-1].end == 1450
    for before, after in itertools.pairwise(windows):
        assert after.start == before.end - 22 and after.overlap == 22
    for window in windows:
        assert window.num_frames % 17 == 5 and window.num_frames <= 277
        assert window.audio_start == round(window.start * 5 / 3)
    # What each window adds after its overlap is discarded sums to the clip's latents, video and audio.
    assert windows[0].num_latent_frames + sum(
        w.num_latent_frames - w.overlap_latent_frames for w in windows[1:]
    ) == geometry.video_latent_frames(1450)
    assert sum(w.num_audio_latents - w.overlap_audio_latents for w in windows) == audio_boundary(1450)
    assert windows[1].temporal_offset == pytest.approx(255 * 40 / 24)


def test_long_lengths_and_window_options_are_checked():
    assert long_frames(15.0, None, 60) is None and long_frames(14.0, None, 60) is None  # plain requests
    assert long_frames(30.0, None, 60) == 736 and long_frames(60.0, None, 60) == 1450
    with pytest.raises(RequestError, match="from 5 to 60") as error:
        long_frames(61.0, None, 60)
    assert error.value.field == "seconds"
    assert check_windows() == (277, 22)
    for window, overlap, field, words in (
        (278, None, "window_frames", "17n\\+5"),
        (None, 23, "overlap_frames", "17n\\+5"),
        (90, None, "window_frames", "124 to 345"),
        (124, 124, "overlap_frames", "shorter than window_frames"),
    ):
        with pytest.raises(RequestError, match=words) as error:
            check_windows(window, overlap)
        assert error.value.field == field
    with pytest.raises(RequestError, match="this request has 3 windows") as error:
        window_prompts("a", ["a", "b"], 3)
    assert error.value.field == "prompts"
    assert window_prompts("a", ["b"], 3) == ["b", "b", "b"] and window_prompts("a", None, 2) == ["a", "a"]


def test_guide_rows_share_the_targets_first_positions_and_media_move_by_the_offset():
    plain = build_layout(5, 12, 4, 4, 20)
    shifted = build_layout(5, 12, 4, 4, 20, media_offset=10.0, guide_frames=7, guide_audio_latents=9)
    rows = 4  # per latent frame (4x4 latents, 2x2 patches)
    assert shifted.num_condition_video_rows == 7 * rows and shifted.num_condition_audio_rows == 18
    pos, video, audio = shifted.position_ids, shifted.video_indices, shifted.audio_indices
    assert torch.equal(pos[video[: 7 * rows]], pos[video[7 * rows : 14 * rows]])  # guide = targets' first 7 frames
    guide_audio, target_audio = audio[:18].view(2, 9), audio[18:].view(2, 20)
    assert torch.equal(pos[guide_audio], pos[target_audio[:, :9]])
    assert torch.equal(pos[:5], plain.position_ids[:5])  # text stays
    target = pos[video[7 * rows :]]
    assert torch.allclose(target[:, 0], plain.position_ids[plain.video_indices][:, 0] + 10.0)
    # ref2va: the references keep their places; the guide follows them on the targets' clock.
    blocks = [ReferenceBlock("image", 1, 4, 4)]
    plain = build_ref2va_layout(torch.ones(5, dtype=torch.long), blocks, 12, 4, 4, 20)
    shifted = build_ref2va_layout(
        torch.ones(5, dtype=torch.long), blocks, 12, 4, 4, 20, media_offset=10.0, guide_frames=7, guide_audio_latents=9
    )
    pos = shifted.position_ids
    assert torch.equal(pos[shifted.video_indices[:rows]], plain.position_ids[plain.video_indices[:rows]])
    guide = shifted.video_indices[rows : 8 * rows]
    assert torch.equal(pos[guide], pos[shifted.video_indices[8 * rows : 15 * rows]])
    assert shifted.num_condition_video_rows == 8 * rows and shifted.num_condition_audio_rows == 18


# ---------------------------------------------------------------------------------------------- piecewise decoding


def test_piecewise_decodes_equal_one_decode(pipe):
    from h3gen.pipelines.h3.vae import decode_audio, decode_video
    from h3gen.pipelines.h3.vae_stream import AudioDecodeStream, VideoDecodeStream

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 24, 5 * 5 + 2, 4, 4, generator=generator)
    stream = VideoDecodeStream(pipe.vae)
    pieces = [stream.push(latents[:, :, a:b]) for a, b in ((0, 7), (7, 8), (8, 20), (20, 27))]
    pieces.append(stream.finish().cpu().numpy())
    assert np.array_equal(np.concatenate([p for p in pieces if len(p)]), decode_video(pipe.vae, latents))

    sound = torch.randn(2, 32, 400, generator=generator)
    whole = decode_audio(pipe.audio_vae, sound)
    for context, close in ((None, True), (0, False)):
        stream = AudioDecodeStream(pipe.audio_vae, context=context, stretch=100)
        pieces = [stream.push(sound[..., a:b]) for a, b in ((0, 150), (150, 151), (151, 400))] + [stream.finish()]
        joined = np.concatenate(pieces, axis=1)
        assert joined.shape == whole.shape
        # With the decoder's reach as context the pieces are one decode; without it the edges show.
        assert (np.abs(joined - whole).max() <= 1e-5) == close


# ---------------------------------------------------------------------------------------------- whole requests


def _seam_steps(path, windows):
    """(largest sample step within 10 ms of each seam, the clip's 99.9th-percentile step) of the MP4's sound."""
    import av

    with av.open(str(path)) as container:
        rate = container.streams.audio[0].codec_context.sample_rate
        sound = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)
    steps = np.abs(np.diff(sound, axis=1)).max(axis=0)
    hop = rate // 40
    seams = [audio_boundary(w.start + w.overlap) * hop for w in windows[1:]]
    return [steps[s - rate // 100 : s + rate // 100].max() for s in seams], np.percentile(steps, 99.9)


def test_30s_request_streams_an_mp4_whose_first_window_is_the_plain_request(pipe, tmp_path, monkeypatch):
    calls = record_windows(pipe, monkeypatch)
    stages = []
    out = pipe(
        "a cat walks on a beach",
        seconds=30,
        seed=5,
        output_path=tmp_path / "long.mp4",
        callback=lambda stage, step, total: stages.append((stage, step, total)),
        **CANVAS,
    )
    assert out.video is None and out.path == str(tmp_path / "long.mp4") and out.windows == 3
    info = probe_mp4(out.path)
    assert info == out.media
    assert 30.0 <= info.video_seconds <= 30.0 + 17 / 24 and abs(info.audio_seconds - info.video_seconds) <= 1 / 24
    assert [s for s in stages if s[0] == "window"] == [("window", i, 3) for i in range(4)]
    assert sum(1 for s in stages if s == ("denoise", 0, 1)) == 3  # every window's own steps are reported

    windows = plan_windows(736, 277, 22)
    assert [tuple(c[0].shape[2:3]) + (c[1].shape[-1],) for c in calls] == [
        (w.num_latent_frames, w.num_audio_latents) for w in windows
    ]
    long_first = calls[0]
    calls.clear()
    plain = pipe("a cat walks on a beach", num_frames=277, seed=5, decode=False, **CANVAS)
    assert plain.video is None and len(calls) == 1
    assert torch.equal(long_first[0], calls[0][0]) and torch.equal(long_first[1], calls[0][1])

    near_seams, typical = _seam_steps(out.path, windows)
    assert max(near_seams) <= 1.5 * typical, (near_seams, typical)


def test_fl2va_keyframes_hold_the_ends_and_ref2va_references_every_window(pipe, tmp_path, monkeypatch):
    from PIL import Image

    from h3gen.pipelines.h3.pipeline import ImageReference

    first, last = tmp_path / "first.png", tmp_path / "last.png"
    Image.new("RGB", (64, 64), (200, 10, 10)).save(first)
    Image.new("RGB", (64, 64), (10, 10, 200)).save(last)
    requests = []
    calls = record_windows(pipe, monkeypatch, requests)
    pipe(
        "a cat",
        image=first,
        last_image=last,
        seconds=25,
        seed=2,
        decode=False,
        prompts=["one", "two", "three"],
        **CANVAS,
    )
    assert [r.anchors for r in requests] == [("first",), (), ("last",)]
    assert [r.prompt for r in requests] == ["one", "two", "three"]
    long_first = calls[0]
    calls.clear()
    pipe("one", image=first, num_frames=277, seed=2, decode=False, **CANVAS)  # window 0 = the plain fl2va request
    assert torch.equal(long_first[0], calls[0][0]) and torch.equal(long_first[1], calls[0][1])

    requests.clear()
    pipe("a cat", references=[ImageReference(first)], seconds=16, seed=2, decode=False, **CANVAS)
    assert len(requests) == 2 and all(r.task == "ref2va" and len(r.references) == 1 for r in requests)


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
    torch.set_num_threads(1)
    pipe = H3Pipeline.from_pretrained(tiny_checkpoint(), device="cpu", torch_dtype=torch.float32)
    out = pipe("a cat", seconds=float(sys.argv[1]), seed=1, height=160, width=160, num_inference_steps=2,
               output_path=sys.argv[2])
    print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "seconds": out.media.video_seconds,
                      "audio": out.media.audio_seconds}))
""")


def test_60s_request_peaks_like_a_15s_one_and_lasts_a_minute(tmp_path):
    """Peak RSS of a whole process (model included) making 15 s and 60 s at 160x160: holding the minute's frames
    (1,450 x 160 x 160 x 3 float32 = 445 MB, twice that with the decoder's own copy) would show; streaming keeps the
    60 s peak within 1.2x of the 15 s one."""
    script = tmp_path / "peak.py"
    script.write_text(MEMORY_SCRIPT)
    found = {}
    for seconds in (15, 60):
        done = subprocess.run(
            [sys.executable, str(script), str(seconds), str(tmp_path / f"{seconds}.mp4")],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        found[seconds] = json.loads(done.stdout.strip().splitlines()[-1])
    assert 60.0 <= found[60]["seconds"] <= 60.0 + 17 / 24
    assert abs(found[60]["audio"] - found[60]["seconds"]) <= 1 / 24
    print(found)
    assert found[60]["peak"] <= 1.2 * found[15]["peak"], found
    near_seams, typical = _seam_steps(tmp_path / "60.mp4", plan_windows(1450, 277, 22))
    assert max(near_seams) <= 1.5 * typical, (near_seams, typical)


# ---------------------------------------------------------------------------------------------- faces and errors


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(seconds=61), "seconds", "5 to 60"),
        (dict(seconds=30, prompts=["a", "b"]), "prompts", "this request has 3 windows"),
        (dict(seconds=30, window_frames=250), "window_frames", "17n\\+5"),
        (dict(seconds=30, overlap_frames=277), "overlap_frames", "shorter than window_frames"),
        (dict(seconds=30), "output_path", "output_path"),
    ],
)
def test_python_errors_name_the_rule(pipe, kwargs, field, words):
    with pytest.raises(RequestError, match=words) as error:
        pipe("a cat", seed=1, **CANVAS, **kwargs)
    assert error.value.field == field


def test_max_seconds_can_be_raised_to_300(pipe):
    from h3gen.pipelines.h3.continuation import check_max_seconds

    assert check_max_seconds(300) == 300.0
    with pytest.raises(RequestError, match="15 to 300"):
        check_max_seconds(301)
    request = pipe.validate("a cat", seconds=61, max_seconds=120, seed=1, **CANVAS)
    assert request.continuation.num_windows == 6 and request.shape.num_frames % 17 == 5


# ---------------------------------------------------------------------------------------------- parallel


def _parallel_worker(rank, world, init_file, model_dir, result_dir):
    import datetime
    import os

    import torch.distributed as dist

    from h3gen.parallel import init_parallel
    from h3gen.pipelines.h3 import long_video
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.stages import denoise as original

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        runs = []
        for tp, sp in ((1, world), (world, 1)):  # the tiny model has 2 heads: Ulysses 2, then TP 2
            state = init_parallel(tp, sp, 2)
            pipe = H3Pipeline.from_pretrained(model_dir, device="cpu", torch_dtype=torch.float32, parallel=state)
            windows = []

            def denoise(*args, windows=windows, **kwargs):
                result = original(*args, **kwargs)
                windows.append((result.video.clone(), result.audio.clone()))
                return result

            long_video.denoise = denoise  # a spawned process of its own: nothing to restore
            pipe("a cat on a piano", seconds=16, seed=4, decode=False, **CANVAS)
            runs.append({"tp": tp, "sp": sp, "windows": windows})
        torch.save(runs, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_long_request_under_tp2_and_ulysses2_equals_one_process(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    from h3gen.pipelines.h3.pipeline import H3Pipeline

    model_dir = tiny_checkpoint(cache_dir=tmp_path / "cache")
    single = H3Pipeline.from_pretrained(model_dir, device="cpu", torch_dtype=torch.float32)
    calls = record_windows(single, monkeypatch)
    single("a cat on a piano", seconds=16, seed=4, decode=False, **CANVAS)
    assert len(calls) == 2  # 16 s = 396 frames: windows [0, 277) and [255, 396)
    mp.spawn(_parallel_worker, args=(2, str(tmp_path / "init"), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        runs = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert [(run["tp"], run["sp"]) for run in runs] == [(1, 2), (2, 1)]
        for run in runs:
            assert len(run["windows"]) == 2
            for (video, audio), (video_1, audio_1) in zip(run["windows"], calls, strict=True):
                assert (video - video_1).abs().max() <= 1e-4 and (audio - audio_1).abs().max() <= 1e-4


def test_server_engine_streams_a_long_job_and_its_limit_is_a_flag(tmp_path):
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import progress_of
    from h3gen.server.schemas import GenerationBody

    engine = H3Engine(tiny_checkpoint(), device="cpu", max_seconds=90)
    request = engine.validate(
        GenerationBody(prompt="a cat", seconds=75, num_inference_steps=2, seed=3, aspect_ratio="1:1"), {}
    )
    assert request["windows"] == 7 and request["num_frames"] == 1807  # vLLM-Omni's example: 7 windows
    with pytest.raises(RequestError, match="5 to 90") as error:
        engine.validate(GenerationBody(prompt="a cat", seconds=91), {})
    assert error.value.field == "seconds"
    with pytest.raises(RequestError, match="this request has 2 windows"):
        engine.validate(GenerationBody(prompt="a cat", seconds=16, prompts=["a", "b", "c"]), {})

    engine.load()
    request = engine.validate(
        GenerationBody(
            prompt="a cat", seconds=16, num_inference_steps=2, seed=3, prompts=["a cat sleeps", "a cat wakes"]
        ),
        {},
    )
    request |= {"height": 64, "width": 64}  # a small canvas for the CPU
    reports = []
    engine.run(request, {}, tmp_path / "job.mp4", lambda stage, step, total: reports.append((stage, step, total)))
    info = probe_mp4(tmp_path / "job.mp4")
    assert info.num_frames == 396 and abs(info.audio_seconds - info.video_seconds) <= 1 / 24
    assert [r for r in reports if r[0] == "window"] == [("window", 0, 2), ("window", 1, 2), ("window", 2, 2)]
    # Job progress: each window an equal share, its stages inside it.
    assert progress_of("denoise", 0, 1, (0, 2)) < progress_of("write_mp4", 1, 1, (0, 2)) <= 50.0
    assert 50.0 <= progress_of("encode_text", 0, 1, (1, 2)) < progress_of("denoise", 1, 1, (1, 2)) <= 99.0


def test_ui_sends_prompts_per_window_and_shows_the_rule(tmp_path):
    from types import SimpleNamespace

    from h3gen.server.engine import H3Engine
    from h3gen.ui.actions import Actions, long_clip_fields
    from h3gen.ui.blocks import build_ui

    assert long_clip_fields("one\n\n two \n", 277.0, None) == {"prompts": ["one", "two"], "window_frames": 277}
    engine = H3Engine(tiny_checkpoint(), device="cpu", max_seconds=120)
    staging = tmp_path / "staging"

    def staging_dir():
        staging.mkdir(exist_ok=True)
        return staging

    manager = SimpleNamespace(engine=engine, staging_dir=staging_dir, list=lambda *args, **kwargs: ([], False))
    actions = Actions(manager)
    for lines, window, overlap, words in (
        ("a\nb", 277, 22, "prompts must hold one prompt per window or one for all: this request has 3 windows"),
        ("", 250, 22, "window_frames must be a frame count on the 17n+5 grid"),
        ("", 277, 277, "overlap_frames must be shorter than window_frames"),
    ):
        status = next(
            actions.generate("a cat", "t2va", None, None, None, "auto", 30, 2, 0, True, False, lines, window, overlap)
        )[0]
        assert words in status, status
    slider = next(block for block in build_ui(manager).blocks.values() if getattr(block, "elem_id", None) == "seconds")
    assert slider.maximum == 120
