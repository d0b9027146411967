"""Stages report when they start and at points inside them: a job's status names the stage that is running
(decode_audio included), a cancel takes effect within 0.5 s in every stage, stage timings are each stage's own, and
the CLI bar names the running stage. The tiny model on the CPU, each stage in turn slowed by sleeps in its own
leaf modules (the way a full-size stage is slow: everywhere inside it)."""

import time
from contextlib import contextmanager, nullcontext

import av
import pytest
import torch
from helpers.server_harness import wait_loaded
from PIL import Image

from h3gen.cli.progress import progress_bar
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.engine import H3Engine
from h3gen.server.jobs import STAGE_ORDER, JobManager
from h3gen.server.schemas import GenerationBody

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

CANCEL_SECONDS = 0.5


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    instance = JobManager(
        H3Engine(tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache")), device="cpu"),
        tmp_path_factory.mktemp("jobs") / "results",
        max_queue=8,
    )
    instance.start()
    assert wait_loaded(instance.engine, 300) and instance.engine.ready
    yield instance
    instance.stop()


@pytest.fixture(autouse=True)
def quick_audio_activations(monkeypatch):
    """The tiny audio decoder's anti-aliased activations take most of a CPU job (a minute on a busy machine);
    identity here. Their modules still run, so the pipeline's points before them still fire."""
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import MiniMaxH3AudioActivation1d

    monkeypatch.setattr(MiniMaxH3AudioActivation1d, "forward", lambda self, hidden_states: hidden_states)


@contextmanager
def _slowed(modules, seconds: float):
    handles = [module.register_forward_pre_hook(lambda *_: time.sleep(seconds)) for module in modules]
    assert handles, "nothing to slow down"
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _leaves(root, kind):
    return [module for module in root.modules() if isinstance(module, kind)]


def _submit(manager, uploads=None, **fields):
    request = GenerationBody(prompt="x", num_inference_steps=fields.pop("steps", 3), **fields)
    return manager.submit(manager.engine.validate(request, uploads or {}), uploads)


def _slow_stage(stage: str, pipe, monkeypatch):
    """A context that makes `stage` last seconds, spread over its leaf modules (or frames, for the MP4 write)."""
    if stage == "encode_text":
        return _slowed(_leaves(pipe.text_encoder.model.model.language_model, torch.nn.Linear), 0.01)
    if stage == "encode_conditions":
        return _slowed(_leaves(pipe.vae.encoder, torch.nn.Conv3d), 0.1)
    if stage == "denoise":
        return _slowed([pipe.transformer], 0.2)
    if stage == "decode_video":
        return _slowed(_leaves(pipe.vae.decoder, torch.nn.Linear), 0.05)
    if stage == "decode_audio":
        from diffusers.models.autoencoders.autoencoder_kl_minimax_h3_audio import MiniMaxH3AudioActivation1d

        return _slowed(_leaves(pipe.audio_vae.decoder, MiniMaxH3AudioActivation1d), 0.03)
    assert stage == "write_mp4"
    from_ndarray = av.VideoFrame.from_ndarray

    def slow_frame(*args, **kwargs):
        time.sleep(0.03)
        return from_ndarray(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", staticmethod(slow_frame))
    return nullcontext()


@pytest.mark.parametrize(
    "stage", ["encode_text", "encode_conditions", "denoise", "decode_video", "decode_audio", "write_mp4"]
)
def test_a_cancel_takes_effect_within_half_a_second_in_every_stage(manager, stage, monkeypatch, tmp_path):
    uploads, fields = None, {}
    if stage == "encode_conditions":
        image = manager.staging_dir() / "image.png"
        Image.new("RGB", (96, 64), (10, 200, 30)).save(image)
        uploads, fields = {"image": image}, {"task": "fl2va"}
    if stage == "denoise":
        fields["steps"] = 30
    with _slow_stage(stage, manager.engine.pipeline, monkeypatch):
        job = _submit(manager, uploads, **fields)
        deadline = time.monotonic() + 300
        while (view := manager.get(job["id"]))["stage"] != stage:  # the running stage is the one shown
            assert view["status"] in ("queued", "running") and time.monotonic() < deadline, view
            time.sleep(0.005)
        time.sleep(0.15)  # well inside the stage
        started = time.monotonic()
        view = manager.cancel(job["id"])
        took = time.monotonic() - started
    assert view["status"] == "cancelled" and view["stage"] is None, view
    assert took < CANCEL_SECONDS, f"the cancel took {took:.2f} s in {stage}"
    assert manager.running is None and not (manager.results_dir / f"{job['id']}.mp4").exists()


def test_status_names_each_stage_while_it_runs_and_times_each_on_its_own(manager, monkeypatch):
    seen = []
    run = manager.engine.run

    def spying(request, images, out_path, callback):
        def spy(stage, step, total):
            callback(stage, step, total)
            seen.append((stage, step, manager.get(manager.running)["stage"]))

        return run(request, images, out_path, spy)

    monkeypatch.setattr(manager.engine, "run", spying)
    job = _submit(manager)
    view = manager.wait(job["id"], 300)
    assert view["status"] == "succeeded", view
    assert all(stage == shown for stage, _, shown in seen)
    order = [stage for index, (stage, _, _) in enumerate(seen) if index == 0 or seen[index - 1][0] != stage]
    assert order == ["encode_text", "denoise", "decode_video", "decode_audio", "write_mp4"]
    first_steps = {}
    for stage, step, _ in seen:
        first_steps.setdefault(stage, step)
    assert set(first_steps.values()) == {0}  # every stage reported as it started
    assert [stage for stage in STAGE_ORDER if stage in view["timings"]] == order
    assert sum(view["timings"].values()) <= view["finished_at"] - view["started_at"]
    assert all(seconds > 0 for seconds in view["timings"].values())


def _named(bar) -> str:
    return bar.desc.removesuffix(": ")


def test_the_cli_bar_names_the_running_stage_and_ends_full():
    bar, callback = progress_bar(
        {"encode_text": 1, "encode_conditions": 0, "denoise": 4, "decode_video": 1, "decode_audio": 1, "write_mp4": 1}
    )
    try:
        callback("encode_text", 0, 1)
        assert _named(bar) == "encode_text" and bar.n == 0
        callback("encode_text", 1, 1)
        callback("denoise", 0, 4)
        assert _named(bar) == "denoise" and bar.n == 1
        for step in range(1, 5):
            callback("denoise", step, 4)
        assert bar.n == 5
        callback("decode_video", 0, 1)
        callback("decode_video", 0, 1)  # a point inside the stage: no progress, same name
        assert _named(bar) == "decode_video" and bar.n == 5
        callback("decode_video", 1, 1)
        callback("decode_audio", 0, 1)
        assert _named(bar) == "decode_audio" and bar.n == 6
        callback("decode_audio", 1, 1)
        callback("write_mp4", 0, 1)
        for frame in range(1, 249):
            callback("write_mp4", frame, 248)
        callback("write_mp4", 1, 1)
        assert bar.n == bar.total == 8
    finally:
        bar.close()
