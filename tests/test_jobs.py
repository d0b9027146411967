"""The job manager in-process: failure isolation, retention, progress accounting, a model that fails to load."""

import time

import pytest
from helpers.server_harness import wait_loaded
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.engine import H3Engine
from h3gen.server.jobs import JobManager, progress_of
from h3gen.server.schemas import GenerationBody

# Job managers running tiny-model jobs: outside the fast tier.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def manager(model, tmp_path):
    instance = JobManager(H3Engine(model, device="cpu"), tmp_path / "results", max_queue=8)
    instance.start()
    yield instance
    instance.stop()


def _submit(manager, uploads=None, **fields):
    request = GenerationBody(prompt=fields.pop("prompt", "x"), num_inference_steps=fields.pop("steps", 2), **fields)
    return manager.submit(manager.engine.validate(request, uploads or {}), uploads)


def test_a_failing_job_fails_alone(manager, tmp_path):
    image = tmp_path / "key.png"
    Image.new("RGB", (90, 50), (1, 2, 3)).save(image)
    staging = manager.staging_dir()
    staged = staging / "image.png"
    staged.write_bytes(image.read_bytes())
    broken = _submit(manager, {"image": staged}, task="fl2va", steps=40)
    upload = manager.uploads_dir / broken["id"] / "image.png"
    upload.write_bytes(b"garbage now")  # the upload goes bad after validation: the job must fail, not the worker
    after = _submit(manager)
    assert manager.wait(broken["id"], 60)["status"] == "failed"
    assert "not a readable image" in manager.get(broken["id"])["error"]
    assert manager.wait(after["id"], 60)["status"] == "succeeded"
    assert (manager.uploads_dir / broken["id"]).exists()  # a finished job keeps its uploads (a remix reuses them)
    manager.cancel(broken["id"])  # deleting the job removes them
    assert not (manager.uploads_dir / broken["id"]).exists()


def test_retention_by_size_then_by_age(manager):
    jobs = [_submit(manager, seed=i) for i in range(3)]
    for job in jobs:
        assert manager.wait(job["id"], 60)["status"] == "succeeded"
    sizes = [manager.store.get(job["id"]).result_bytes for job in jobs]
    manager.max_results_bytes = sizes[1] + sizes[2]
    manager.sweep()
    assert manager.get(jobs[0]["id"]) is None and not (manager.results_dir / f"{jobs[0]['id']}.mp4").exists()
    assert manager.get(jobs[1]["id"]) and manager.get(jobs[2]["id"])
    manager.store.update(jobs[1]["id"], finished_at=time.time() - 3600)
    manager.retention_seconds = 1800
    manager.sweep()
    assert manager.get(jobs[1]["id"]) is None and manager.get(jobs[2]["id"])["status"] == "succeeded"


def test_progress_covers_every_stage_in_order():
    points = [
        progress_of("encode_text", 1, 1),
        progress_of("denoise", 1, 10),
        progress_of("denoise", 10, 10),
        progress_of("decode_video", 1, 1),
        progress_of("write_mp4", 1, 1),
    ]
    assert points == sorted(points) and points[-1] == 99.0 and points[0] > 0


def test_a_model_that_fails_to_load_fails_jobs_with_the_reason(model, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    manager = JobManager(H3Engine(broken, device="cpu"), tmp_path / "results")
    manager.start()
    try:
        assert wait_loaded(manager.engine, 60) and not manager.engine.ready
        job = _submit(manager)
        view = manager.wait(job["id"], 30)
        assert view["status"] == "failed" and "failed to load" in view["error"]
    finally:
        manager.stop()


def test_quality_is_validated_and_recorded(manager):
    from h3gen.errors import RequestError

    with pytest.raises(RequestError) as info:
        manager.engine.validate(GenerationBody(prompt="x", quality="fast"), {})
    assert info.value.field == "quality"
    job = _submit(manager, quality="exact")
    view = manager.wait(job["id"], 60)
    assert view["status"] == "succeeded" and view["request"]["quality"] == "exact"


def test_a_queued_ref2va_job_keeps_its_references_until_it_runs(manager, tmp_path):
    from helpers.media_files import tone, write_audio

    first = _submit(manager, steps=200)  # keeps the engine busy, so the next job waits in the queue
    staging = manager.staging_dir()
    Image.new("RGB", (50, 80), (1, 2, 3)).save(staging / "ref_image_0.png")
    write_audio(staging / "ref_audio_1.wav", tone(1.0, 32000), 32000)
    job = _submit(
        manager, {"ref_image_0": staging / "ref_image_0.png", "ref_audio_1": staging / "ref_audio_1.wav"}, task="ref2va"
    )
    assert job["status"] == "queued" and job["request"]["references"] == ["image", "audio"]
    kept = manager.uploads_dir / job["id"]
    assert sorted(path.name for path in kept.iterdir()) == ["ref_audio_1.wav", "ref_image_0.png"]
    assert not staging.exists()  # moved, not copied: the job owns them now, and the emptied staging folder goes
    manager.cancel(first["id"])
    done = manager.wait(job["id"], 120)
    assert done["status"] == "succeeded", done
    assert kept.exists()  # kept while the job is (a remix reuses them) ...
    manager.cancel(job["id"])
    assert not kept.exists()  # ... and gone with it
