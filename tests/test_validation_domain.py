"""What validation accepts runs: every numeric field of a request at and near each of its bounds, through the
server's engine (validate, then run) on the tiny model, ends in an MP4 that decodes; just past a bound is refused
naming the field."""

import random

import pytest

from h3gen.errors import RequestError
from h3gen.media import probe_mp4
from h3gen.pipelines.h3.recipes import MAX_SHIFT, MIN_SHIFT
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.server.engine import H3Engine
from h3gen.server.schemas import GenerationBody

FAST = {"num_inference_steps": 2}
_near = random.Random(7)


def _inside(low: float, high: float) -> tuple[float, float]:
    """A value drawn just inside each bound (within a thousandth of the range)."""
    span = (high - low) * 1e-3
    return low + _near.uniform(0, span), high - _near.uniform(0, span)


LOW_SHIFT, HIGH_SHIFT = _inside(MIN_SHIFT, MAX_SHIFT)
AT_BOUNDS = {
    "shifts at the bounds": dict(video_shift=MIN_SHIFT, audio_shift=MAX_SHIFT, seed=0, **FAST),
    "shifts at the other bounds": dict(video_shift=MAX_SHIFT, audio_shift=MIN_SHIFT, seed=2**63 - 1, **FAST),
    "shifts near the bounds": dict(video_shift=LOW_SHIFT, audio_shift=HIGH_SHIFT, **FAST),
    "shifts near the other bounds": dict(video_shift=HIGH_SHIFT, audio_shift=LOW_SHIFT, **FAST),
    "low shifts at the most forwards": dict(video_shift=MIN_SHIFT, audio_shift=MIN_SHIFT, num_inference_steps=1000),
    "one forward": dict(forwards=1, video_shift=MAX_SHIFT, audio_shift=MAX_SHIFT),
    "shortest clip": dict(seconds=5, **FAST),
    "longest single request": dict(seconds=15, **FAST),
    "just over one request": dict(seconds=15.01, window_frames=124, overlap_frames=5, **FAST),
    "longest clip, longest windows": dict(seconds=60, window_frames=345, overlap_frames=5, **FAST),
    "longest overlap": dict(seconds=16, window_frames=345, overlap_frames=328, **FAST),
    "step cache at its bounds": dict(
        quality="high", cache={"threshold": 1.0, "warmup": 0, "max_consecutive": 1000}, num_inference_steps=6
    ),
    "step cache at its other bounds": dict(
        quality="high", cache={"threshold": 0.0, "warmup": 1000, "max_consecutive": 1}, num_inference_steps=6
    ),
    "narrowest and widest canvas": dict(aspect_ratio="1:4", audio_sample_rate=48000, **FAST),
}
SLOW = {"low shifts at the most forwards", "longest clip, longest windows"}
PAST_BOUNDS = [
    (dict(video_shift=MIN_SHIFT * 0.999), "video_shift"),
    (dict(audio_shift=MAX_SHIFT * 1.001), "audio_shift"),
    (dict(seconds=4.99), "seconds"),
    (dict(seconds=60.01), "seconds"),
    (dict(num_inference_steps=1001), "num_inference_steps"),
    (dict(forwards=0), "forwards"),
    (dict(seconds=30, window_frames=107), "window_frames"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = H3Engine(tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache")), device="cpu")
    engine.load()
    assert engine.load_error is None, engine.load_error
    return engine


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in AT_BOUNDS]
)
def test_values_at_and_near_every_bound_run_to_an_mp4(engine, tmp_path, name):
    fields = AT_BOUNDS[name]
    request = engine.validate(GenerationBody(prompt="a cat", **fields), {})
    out = tmp_path / "clip.mp4"
    engine.run(request, {}, out, lambda stage, step, total: None)
    info = probe_mp4(out)
    assert info.num_frames == request["num_frames"] and info.audio_channels == 2
    assert info.sample_rate == request["audio_sample_rate"]


@pytest.mark.parametrize("fields, field", PAST_BOUNDS)
def test_values_just_past_a_bound_are_refused_naming_the_field(engine, fields, field):
    with pytest.raises((RequestError, ValueError)) as error:
        engine.validate(GenerationBody(prompt="a cat", **fields), {})
    assert field in str(error.value)
