"""The first-block step cache (quality high): the decision rule step by step on a stack whose block-0 residuals are
set by the test; on the tiny model, threshold 0 equals lossless exactly and a threshold of 1 caches exactly the
forwards the rule allows, running only block 0 on them; layer-wise offload copies no block but block 0 for a cached
forward; TP 2 and Ulysses 2 decide and compute as one process; the knobs are validated on every face."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from helpers.h3_tiny import TINY_CONFIGS, max_rel_err, random_inputs, randomize_

from h3gen.errors import RequestError
from h3gen.offload import apply_layerwise_offload
from h3gen.options import RunOptions
from h3gen.pipelines.h3.step_cache import StepCache, step_cache
from h3gen.pipelines.h3.step_cache_config import StepCacheConfig
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer

# ------------------------------------------------------------------------------------------------ the rule


class ScaledResidual(nn.Module):
    """Block 0 of the fake stack: adds `scale` (set per forward by the test) to every element."""

    def __init__(self):
        super().__init__()
        self.scale = 0.0

    def forward(self, x):
        return x + self.scale


class Stack:
    """A fake block stack: block 0 adds a controlled residual, block i > 0 adds `i * value` (value set per forward,
    so a reused tail shows which forward it came from). Counts block calls per forward."""

    def __init__(self, num_blocks: int = 4):
        self.first = ScaledResidual()
        self.num_blocks = num_blocks
        self.value = 0.0
        self.calls: list[int] = []

    def run(self, index: int, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(index)
        return self.first(x) if index == 0 else x + index * self.value

    def forward(self, cache: StepCache, scale: float, value: float) -> torch.Tensor:
        self.first.scale, self.value, self.calls = scale, value, []
        # A zero input: block 0's residual is exactly `scale` everywhere, so the diffs are exact.
        return cache.run_blocks(self.num_blocks, torch.zeros(1, 8, 4, dtype=torch.float64), self.run, self.first)


def _drive(config: StepCacheConfig, scales: list[float]):
    stack, cache = Stack(), StepCache(config, len(scales))
    outputs, calls = [], []
    for step, scale in enumerate(scales):
        outputs.append(stack.forward(cache, scale, value=float(step + 1)))
        calls.append(stack.calls)
    return cache, outputs, calls


BELOW, ABOVE = 25 + 127 / 128, 26 + 1 / 128  # relative to 25: 0.0396875 and 0.0403125


def test_rule_step_by_step_at_the_anchors_settings():
    # threshold 0.04, 4 warm-up forwards, at most 1 cached in a row; diffs are relative to the last computed forward.
    scales = [
        25,
        25,
        25,
        25,  # 0-3 warm-up: computed although nothing changes
        BELOW,  # 4: 0.0396875 < 0.04 -> cached (its residual is not kept: the reference stays 25)
        25,  # 5: one cached in a row already -> computed
        24,  # 6: |24 - 25| / 25 = 0.04 exactly, not below -> computed (the reference becomes 24)
        24,  # 7: 0 -> cached
        25,  # 8: cap -> computed (reference 25)
        ABOVE,  # 9: 0.0403125 -> computed (reference 26.0078125)
        ABOVE,  # 10: 0 -> cached
        ABOVE,
    ]  # 11: the last forward: always computed
    cache, outputs, calls = _drive(StepCacheConfig(), scales)
    assert cache.cached_steps == [4, 7, 10]
    assert cache.computed_steps == [0, 1, 2, 3, 5, 6, 8, 9, 11]
    assert cache.diffs[:4] == [None] * 4 and cache.diffs[5] is None and cache.diffs[8] is None
    assert cache.diffs[4] == pytest.approx(0.0396875, abs=1e-15)
    assert cache.diffs[6] == 0.04 and cache.diffs[7] == 0.0 and cache.diffs[9] == pytest.approx(0.0403125)
    assert cache.diffs[10] == 0.0 and cache.diffs[11] is None
    for step, (out, blocks) in enumerate(zip(outputs, calls, strict=True)):
        if step in cache.cached_steps:
            assert blocks == [0]
            # block 0's output plus the tail of the last computed forward (blocks 1..3 added 6 x its value)
            last_computed = max(s for s in cache.computed_steps if s < step)
            assert torch.equal(out, torch.full_like(out, scales[step] + 6.0 * (last_computed + 1)))
        else:
            assert blocks == [0, 1, 2, 3]
            assert torch.equal(out, torch.full_like(out, scales[step] + 6.0 * (step + 1)))


def test_rule_cap_warmup_and_the_extreme_thresholds():
    steady = [25.0] * 12
    assert _drive(StepCacheConfig(max_consecutive=2), steady)[0].cached_steps == [4, 5, 7, 8, 10]
    assert _drive(StepCacheConfig(warmup=0), steady)[0].cached_steps == [1, 3, 5, 7, 9]  # forward 0 has no reference
    assert _drive(StepCacheConfig(threshold=0.0), steady)[0].cached_steps == []
    jumpy = [25.0 * 2**i for i in range(12)]  # every diff is 1 or more
    assert _drive(StepCacheConfig(), jumpy)[0].cached_steps == []
    # 1 caches every forward the other rules allow, whatever the diff (Cache-DiT's meaning of >= 1).
    assert _drive(StepCacheConfig(threshold=1.0), jumpy)[0].cached_steps == [4, 6, 8, 10]
    assert _drive(StepCacheConfig(threshold=1.0, warmup=11), steady)[0].cached_steps == []  # only the last is left
    stack, cache = Stack(), StepCache(StepCacheConfig(), 3)
    for _ in range(3):
        stack.forward(cache, 25.0, 1.0)
    with pytest.raises(RuntimeError, match="set up for 3 forwards"):
        stack.forward(cache, 25.0, 1.0)


def test_forced_decisions_replace_the_rule_but_still_measure():
    cache, _, calls = _drive_forced([False, True, False, False, True, False], [25, BELOW, 25, 25, 24, 25])
    assert cache.cached_steps == [1, 4]
    assert [len(c) for c in calls] == [4, 1, 4, 4, 1, 4]
    assert cache.diffs[0] is None and cache.diffs[1] == pytest.approx(0.0396875) and cache.diffs[4] == 0.04
    with pytest.raises(ValueError, match="before any forward was computed"):
        _drive_forced([True, False], [25, 25])


def _drive_forced(forced, scales):
    stack, cache = Stack(), StepCache(StepCacheConfig(), len(forced), forced=forced)
    calls = []
    for step, scale in enumerate(scales):
        stack.forward(cache, scale, value=float(step))
        calls.append(stack.calls)
    return cache, None, calls


def test_knobs_are_validated_naming_the_field():
    assert StepCacheConfig.from_request(None) == StepCacheConfig(0.04, 4, 1)
    assert StepCacheConfig.from_request({"threshold": 0.1, "warmup": 2.0}) == StepCacheConfig(0.1, 2, 1)
    cases = [
        ({"threshold": 1.5}, "cache.threshold", "from 0 to 1"),
        ({"threshold": -0.1}, "cache.threshold", "0 to 1"),
        ({"threshold": "x"}, "cache.threshold", "a number"),
        ({"warmup": -1}, "cache.warmup", "0 to 1000"),
        ({"warmup": 2.5}, "cache.warmup", "whole number"),
        ({"max_consecutive": 0}, "cache.max_consecutive", "1 to 1000"),
        ({"max_consecutive": True}, "cache.max_consecutive", "whole number"),
        ({"speed": 2}, "cache", "threshold, warmup, max_consecutive only"),
        ("fast", "cache", "an object"),
    ]
    for value, field, words in cases:
        with pytest.raises(RequestError, match=words) as info:
            StepCacheConfig.from_request(value)
        assert info.value.field == field, value


def test_high_tiers_in_run_options():
    lossless, fast = RunOptions(), RunOptions(quality="fast")
    assert lossless.request_quality("high") == "high" and RunOptions(quality="high").request_quality(None) == "high"
    assert fast.request_quality("fast+high") == "fast+high"
    assert lossless.servable_tiers() == ("exact", "lossless", "high")
    assert fast.servable_tiers() == RunOptions(quality="fast+high").servable_tiers() == ("fast", "fast+high")
    for options, asked in ((lossless, "fast+high"), (fast, "high"), (RunOptions(quality="fast+high"), "lossless")):
        with pytest.raises(RequestError, match="fast and fast\\+high need a model loaded") as info:
            options.request_quality(asked)
        assert info.value.field == "quality"
    assert RunOptions(quality="fast+high", attention="fa3-fp8").attention_for("fast+high") == "fa3-fp8"


# ------------------------------------------------------------------------------------------------ tiny model

CONFIG = dict(TINY_CONFIGS[2], num_layers=6)
INPUTS = dict(num_text=6, latent_frames=3, latent_hw=(4, 2), audio_latents=7, anchors=("first",), distinct_timesteps=3)


def _drifting_inputs(config, forwards: int, big: tuple[int, ...] = ()):
    """Per forward, the same request with its video and audio rows drifting a little (a lot at the forwards in
    `big`), and its timesteps moving along."""
    base = random_inputs(config, seed=3, **INPUTS)
    generator = torch.Generator().manual_seed(4)
    steps, video, audio = [], base["hidden_states"], base["audio_hidden_states"]
    for step in range(forwards):
        size = 0.5 if step in big else 0.01
        video = video + size * torch.randn(video.shape, generator=generator)
        audio = audio + size * torch.randn(audio.shape, generator=generator)
        steps.append(
            dict(base, hidden_states=video, audio_hidden_states=audio, timestep=base["timestep"] * (1 - 0.02 * step))
        )
    return steps


def _model(config=CONFIG, tier="lossless"):
    model = H3Transformer.from_config(config).eval()
    randomize_(model, seed=5)
    set_quality(model, tier)
    return model


def _run(model, steps, config: StepCacheConfig | None, forced=None):
    tables = model.precompute_adaln([s["timestep"] for s in steps])
    outputs = []
    with torch.no_grad():
        if config is None:
            return [model(**s, adaln_tables=tables, step=i, return_dict=False) for i, s in enumerate(steps)], None
        with step_cache(model, config, len(steps), forced=forced) as cache:
            for i, s in enumerate(steps):
                outputs.append(model(**s, adaln_tables=tables, step=i, return_dict=False))
    assert model.step_cache is None  # detached after the request
    return outputs, cache


def _count_block_calls(model):
    calls = []
    for index, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
    return calls


def test_tiny_transformer_threshold_zero_is_lossless_and_one_caches_what_the_rule_allows():
    steps = _drifting_inputs(CONFIG, 9)
    plain, _ = _run(_model(), steps, None)
    model = _model()
    calls = _count_block_calls(model)
    same, cache = _run(model, steps, StepCacheConfig(threshold=0.0, warmup=2))
    assert cache.cached_steps == [] and len(calls) == 9 * 6
    for got, want in zip(same, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    calls.clear()
    cached, cache = _run(model, steps, StepCacheConfig(threshold=1.0, warmup=2))
    assert cache.cached_steps == [2, 4, 6]  # 8 is the last; 7 follows a cached forward
    per_forward, forward = [], -1
    for index in calls:
        forward += index == 0
        per_forward.append((forward, index))
    for step in range(9):
        ran = [index for f, index in per_forward if f == step]
        assert ran == ([0] if step in cache.cached_steps else list(range(6))), step
    for step, (got, want) in enumerate(zip(cached, plain, strict=True)):
        same_output = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        # the inputs do not feed back here: a computed forward's output is lossless's, a cached one's is not
        assert same_output == (step not in cache.cached_steps), step
        assert all(max_rel_err(a, b) < 0.5 for a, b in zip(got, want, strict=True))  # an approximation, not noise


def test_tiny_transformer_mid_threshold_decides_by_the_diff():
    steps = _drifting_inputs(CONFIG, 10, big=(5, 6))
    _, cache = _run(_model(), steps, StepCacheConfig(threshold=0.1, warmup=2))
    measured = {s: d for s, d in enumerate(cache.diffs) if d is not None}
    assert cache.cached_steps and all(measured[s] < 0.1 for s in cache.cached_steps)
    assert any(d >= 0.1 for d in measured.values())  # a big drift was measured and computed
    assert all(measured[s] >= 0.1 for s in measured if s not in cache.cached_steps)


@pytest.mark.parametrize("resident", [0, 2])
def test_offload_copies_no_block_for_a_cached_forward(resident):
    from test_offload import _block_bytes, _other_bytes

    steps = _drifting_inputs(CONFIG, 9)
    reference = _model()
    expected, ref_cache = _run(reference, steps, StepCacheConfig(threshold=1.0, warmup=2))
    model = _model()
    log = []
    prefetch = 2
    budget = _other_bytes(model) + (resident + prefetch + 1) * _block_bytes(model)
    apply_layerwise_offload(model, "cpu", gpu_memory=budget, activation_reserve=0, prefetch=prefetch, copy_log=log)
    plan = model.offload_plan
    assert len(plan.resident) == resident and (0 in plan.resident) == (resident > 0)  # strided: block 0 resident
    per_forward = []
    # First among block 0's hooks: a forward's copies are counted from before the stream's own hooks run.
    model.transformer_blocks[0].register_forward_pre_hook(lambda *_: per_forward.append(len(log)), prepend=True)
    got, cache = _run(model, steps, StepCacheConfig(threshold=1.0, warmup=2))
    assert cache.cached_steps == ref_cache.cached_steps == [2, 4, 6]
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # The copies issued while each forward ran (from its block 0 to the next forward's block 0).
    bounds = per_forward + [len(log)]
    windows = [log[bounds[i] : bounds[i + 1]] for i in range(9)]
    first = [0] if 0 in plan.streamed else []
    for step in cache.cached_steps:
        assert set(windows[step]) <= set(first), (step, windows[step])
    # Every copy belongs to a computed forward, block 0 of a cached one aside, plus the stream's last prefetch.
    streamed = len(plan.streamed)
    assert len(log) == 6 * streamed + 3 * len(first) + prefetch
    assert log[: bounds[1]] == list(plan.streamed) + list(plan.streamed[:prefetch])


# ------------------------------------------------------------------------------------------------ parallel

PARALLEL_CONFIG = dict(TINY_CONFIGS[2])  # 4 heads: TP2 and SP2
PARALLEL_INPUTS = dict(
    num_text=7, latent_frames=3, latent_hw=(4, 4), audio_latents=7, anchors=("first",), distinct_timesteps=3
)  # 53 rows: padded for SP2


def _parallel_steps():
    base = random_inputs(PARALLEL_CONFIG, seed=12, **PARALLEL_INPUTS)
    generator = torch.Generator().manual_seed(13)
    steps, video = [], base["hidden_states"]
    for step in range(8):
        video = video + (0.6 if step == 4 else 0.01) * torch.randn(video.shape, generator=generator)
        steps.append(dict(base, hidden_states=video, timestep=base["timestep"] * (1 - 0.02 * step)))
    return steps


def _parallel_worker(rank, world, init_file, payload_path, result_dir):
    from helpers.parallel_model import join_gloo, load_full_state_dict, parallel_transformer

    from h3gen.parallel import init_parallel
    from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

    join_gloo(rank, world, init_file)
    payload = torch.load(payload_path)
    results = []
    try:
        for tp, sp in ((2, 1), (1, 2)):
            state = init_parallel(tp, sp, PARALLEL_CONFIG["num_attention_heads"])
            model = parallel_transformer(H3TransformerConfig(**PARALLEL_CONFIG), state).eval()
            load_full_state_dict(model, payload["state_dict"])
            set_quality(model, "lossless")
            outputs, cache = _run(model, payload["steps"], StepCacheConfig(**payload["cache"]))
            results.append({"tp": tp, "sp": sp, "outputs": outputs, "cached": cache.cached_steps, "diffs": cache.diffs})
    finally:
        torch.save(results, os.path.join(result_dir, f"{rank}.pt"))
        dist.destroy_process_group()


def test_tp2_and_ulysses2_decide_and_compute_as_one_process(tmp_path):
    steps = _parallel_steps()
    model = _model(PARALLEL_CONFIG)
    knobs = dict(threshold=0.05, warmup=2)
    expected, cache = _run(model, steps, StepCacheConfig(**knobs))
    measured = [d for d in cache.diffs if d is not None]
    # Both branches are taken, and no diff is near the threshold (float sums differ in the last bits per layout).
    assert cache.cached_steps and len(cache.cached_steps) < 3 and any(d > 0.05 for d in measured)
    assert all(abs(d - 0.05) > 1e-3 for d in measured)
    payload = tmp_path / "payload.pt"
    torch.save({"state_dict": model.state_dict(), "steps": steps, "cache": knobs}, payload)
    mp.spawn(_parallel_worker, args=(2, str(tmp_path / "init"), str(payload), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for result in torch.load(tmp_path / f"{rank}.pt"):
            layout = (result["tp"], result["sp"])
            assert result["cached"] == cache.cached_steps, layout
            for got, want in zip(result["diffs"], cache.diffs, strict=True):
                assert (got is None) == (want is None) and (got is None or abs(got - want) <= 1e-5 * max(want, 1e-3))
            for got, want in zip(result["outputs"], expected, strict=True):
                for a, b in zip(got, want, strict=True):
                    assert max_rel_err(a, b) <= 1e-5, layout


# ------------------------------------------------------------------------------------------------ the pipeline


def test_pipeline_quality_high_reports_cached_steps(tmp_path):
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    pipe = H3Pipeline.from_pretrained(tiny_checkpoint(cache_dir=tmp_path), device="cpu", torch_dtype=torch.float32)
    kwargs = dict(seed=2, num_inference_steps=9, num_frames=130)
    lossless = pipe("a fox", **kwargs)
    zero = pipe("a fox", quality="high", cache={"threshold": 0}, **kwargs)
    assert np.array_equal(zero.video, lossless.video) and np.array_equal(zero.audio, lossless.audio)
    assert zero.cached_steps == [] and zero.computed_steps == list(range(8)) and lossless.cached_steps == []
    every = pipe("a fox", quality="high", cache={"threshold": 1, "warmup": 3}, **kwargs)
    assert every.cached_steps == [3, 5] and every.computed_steps == [0, 1, 2, 4, 6, 7] and every.num_forwards == 8
    assert not np.array_equal(every.video, lossless.video)
    default = pipe("a fox", quality="high", **kwargs)  # the anchors' knobs: whatever the diffs say, within the rule
    assert set(default.cached_steps) <= {4, 6}
    with pytest.raises(RequestError, match="cache applies to quality high or fast\\+high") as info:
        pipe("a fox", cache={"threshold": 0.1}, **kwargs)
    assert info.value.field == "cache"
    with pytest.raises(RequestError, match="cache.warmup must be") as info:
        pipe("a fox", quality="high", cache={"warmup": -1}, **kwargs)
    with pytest.raises(RequestError, match="quality fast\\+high is not available here"):
        pipe("a fox", quality="fast+high", **kwargs)


# ------------------------------------------------------------------------------------------------ faces


def test_rest_cache_field_and_job_status(tmp_path):
    import time

    from fastapi.testclient import TestClient
    from helpers.server_harness import wait_loaded

    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager

    engine = H3Engine(tiny_checkpoint(cache_dir=tmp_path / "cache"), device="cpu")
    manager = JobManager(engine, tmp_path / "results", max_queue=4)
    manager.start()
    try:
        assert wait_loaded(engine, 120)
        http = TestClient(create_app(manager))
        bad = [
            ({"quality": "high", "cache": {"threshold": 2}}, "cache.threshold", "less than or equal to 1"),
            ({"quality": "high", "cache": {"warmup": -1}}, "cache.warmup", "greater than or equal to 0"),
            ({"quality": "high", "cache": {"max_consecutive": 0}}, "cache.max_consecutive", "greater than or equal"),
            ({"quality": "high", "cache": {"speed": 1}}, "cache.speed", "Extra inputs"),
            ({"cache": {"threshold": 0.1}}, "cache", "cache applies to quality high or fast+high"),
            ({"quality": "fast+high"}, "quality", "fast and fast+high need"),
        ]
        for fields, field, words in bad:
            response = http.post("/v1/videos", json={"prompt": "x", **fields})
            assert response.status_code == 422, response.text
            detail = response.json()["detail"]
            where = ".".join(str(p) for p in detail[0]["loc"][1:]) if isinstance(detail, list) else None
            message = detail[0]["msg"] if isinstance(detail, list) else str(detail)
            assert (where or response.json()["error"]["param"]) == field and words in message, response.text
        made = http.post(
            "/v1/videos",
            json={
                "prompt": "a fox",
                "quality": "high",
                "num_inference_steps": 6,
                "cache": {"threshold": 1, "warmup": 1},
            },
        )

        def form(**fields):  # multipart text parts
            return {name: (None, value) for name, value in fields.items()}

        plain = http.post("/v1/videos", files=form(prompt="a fox", num_inference_steps="4"))  # lossless
        text = http.post(
            "/v1/videos",
            files=form(prompt="a fox", quality="high", num_inference_steps="4", cache='{"threshold": 1, "warmup": 0}'),
        )
        assert made.status_code == plain.status_code == text.status_code == 202, (made.text, text.text)
        views = {}
        for name, job in (("made", made), ("plain", plain), ("text", text)):
            deadline = time.monotonic() + 300
            while (view := http.get(f"/v1/videos/{job.json()['id']}").json())["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert view["status"] == "completed", view
            views[name] = view
        # 5 forwards, 1 warm-up: 1 and 3 cached (2 follows a cached one, 4 is the last)
        assert views["made"]["cached_steps"] == [1, 3] and views["made"]["request"]["cache"]["warmup"] == 1
        assert views["plain"]["cached_steps"] is None
        assert views["text"]["cached_steps"] == [1]  # 3 forwards, no warm-up: forward 0 has no reference
    finally:
        manager.stop()


def test_cli_flags_and_ui_choices(tmp_path, capsys):
    from h3gen.cli import main
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
    from h3gen.ui.actions import quality_choices

    model = str(tiny_checkpoint(cache_dir=tmp_path / "cache"))
    base = ["generate", "a fox", "--model", model, "--device", "cpu", "--steps", "5", "--seed", "1"]
    assert main(base + ["--cache-threshold", "0.1", "--out", str(tmp_path / "a.mp4")]) == 2
    assert "apply to --quality high or fast+high (this run is lossless)" in capsys.readouterr().err
    assert main(base + ["--quality", "high", "--cache-threshold", "1.5", "--out", str(tmp_path / "a.mp4")]) == 2
    assert "cache.threshold must be a number from 0 to 1 (got 1.5)" in capsys.readouterr().err
    assert (
        main(
            base
            + ["--quality", "high", "--cache-threshold", "1", "--cache-warmup", "1", "--out", str(tmp_path / "b.mp4")]
        )
        == 0
    )
    # 4 forwards, 1 warm-up: 1 cached, 2 follows it, 3 is the last
    assert capsys.readouterr().err.rstrip().endswith("shifts 12/3, 1 of 4 forwards cached (steps 1)")

    class Engine:
        options = RunOptions(quality="high")

    choices, default = quality_choices(Engine())
    assert [value for _, value in choices] == ["exact", "lossless", "high"] and default == "high"
    assert choices[2][0].startswith("high: lossless plus a first-block step cache")


@pytest.mark.parametrize(
    "loaded,tier,base",
    [
        (dict(quantization="mxfp4"), "high", "lossless"),
        (dict(quality="fast"), "fast+high", "fast"),
        (dict(quality="fast+high", quantization="mxfp4"), None, "fast"),
    ],
    ids=["mxfp4-high", "fast+high", "mxfp4-fast+high-default"],
)
def test_high_stacks_on_mxfp4_and_fast(tmp_path, loaded, tier, base):
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    pipe = H3Pipeline.from_pretrained(
        tiny_checkpoint(cache_dir=tmp_path), device="cpu", torch_dtype=torch.float32, **loaded
    )
    kwargs = dict(seed=3, num_inference_steps=9, num_frames=130)
    plain = pipe("a fox", quality=base, **kwargs)
    zero = pipe("a fox", quality=tier, cache={"threshold": 0}, **kwargs)
    assert np.array_equal(zero.video, plain.video) and np.array_equal(zero.audio, plain.audio)
    every = pipe("a fox", quality=tier, cache={"threshold": 1, "warmup": 3}, **kwargs)
    assert every.cached_steps == [3, 5] and not np.array_equal(every.video, plain.video)


def test_the_gpu_budget_counts_the_cache_residuals(tmp_path, monkeypatch):
    """Under layer-wise offload the activation check counts what the step cache keeps (two residuals of the
    stream): a request that fits lossless within the budget can be refused at quality high."""
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.request import activation_bytes, packed_rows
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    pipe = H3Pipeline.from_pretrained(tiny_checkpoint(cache_dir=tmp_path), device="cpu", torch_dtype=torch.float32)
    request = pipe.validate("a cat", seconds=5)
    rows = packed_rows(request, len(pipe.text_encoder.tokenize("a cat")), pipe.config.patch_size)
    plain = activation_bytes(rows, pipe.config)
    assert activation_bytes(rows, pipe.config, step_cache=True) == plain + rows * 4 * pipe.config.hidden_size
    monkeypatch.setattr(pipe.transformer, "activation_budget_bytes", plain, raising=False)
    pipe.validate("a cat", seconds=5)  # fits without the cache
    with pytest.raises(RequestError, match="activations need about") as error:
        pipe(
            "a cat", seconds=5, num_inference_steps=2, quality="high", callback=lambda *a: pytest.fail("the model ran")
        )
    assert error.value.field == "seconds"
