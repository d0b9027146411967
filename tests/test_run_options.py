"""Run options: one validated object whose values and rules every face (CLI, REST schema, UI, engine, pipeline)
reads; each bad value is a `RequestError` naming the field and what is allowed."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from h3gen.errors import CheckpointError, RequestError
from h3gen.kernels.attention import BACKENDS
from h3gen.offload import host_memory, plan_placement
from h3gen.options import (
    APPROXIMATE_ATTENTION,
    ATTENTION_BACKENDS,
    OFFLOAD_MODES,
    QUALITY_TIERS,
    QUANTIZATIONS,
    TASKS,
    WORKFLOWS,
    RunOptions,
    parse_bytes,
)
from h3gen.pipelines.h3.checkpoint import H3Checkpoint, resolve_workflow


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("quality", "best", QUALITY_TIERS),
        ("offload", "disk", OFFLOAD_MODES),
        ("quantization", "int4", QUANTIZATIONS),
        ("workflow", "i2v", WORKFLOWS),
        ("attention", "xformers", ATTENTION_BACKENDS),
    ],
)
def test_a_value_outside_its_choices_names_the_field_and_every_allowed_value(field, value, allowed):
    with pytest.raises(RequestError) as info:
        RunOptions(**{field: value})
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field} must be one of") and repr(value) in message
    assert all(choice in message for choice in allowed)


@pytest.mark.parametrize(
    "keywords, field, words",
    [
        (dict(offload="layerwise"), "gpu_memory", "needs gpu_memory"),
        (dict(offload="layerwise", gpu_memory="lots"), "gpu_memory", "30GiB"),
        (dict(gpu_memory="0GiB"), "gpu_memory", "more than 0"),
        (dict(prefetch=0), "prefetch", "at least 1"),
        (dict(prefetch=True), "prefetch", "at least 1"),
        (dict(prefetch=1.5), "prefetch", "whole number"),
        (dict(quality="exact", attention="cudnn"), "attention", "quality exact"),
        (dict(quality="lossless", attention="fa3-fp8"), "attention", "quality fast only"),
    ],
)
def test_rules_that_combine_fields_name_the_field(keywords, field, words):
    with pytest.raises(RequestError, match=words) as info:
        RunOptions(**keywords)
    assert info.value.field == field


def test_valid_combinations_and_their_derived_values():
    options = RunOptions(
        offload="layerwise",
        gpu_memory="1.5GB",
        prefetch=1,
        quantization="mxfp4",
        quality="fast",
        attention="fa3-fp8",
        workflow="all",
    )
    assert options.gpu_memory_bytes == 1_500_000_000 == parse_bytes("1.5GB")
    assert options.attention_for("fast") == "fa3-fp8"
    assert RunOptions(attention="cudnn").attention_for("exact") is None  # exact keeps torch's SDPA choice
    assert RunOptions().attention_for("lossless") is None
    assert set(APPROXIMATE_ATTENTION) == {"fa3-fp8", "triton-fp8"} & set(BACKENDS)


def test_merged_keywords_replace_fields_and_none_leaves_them():
    base = RunOptions(quality="exact", offload="stage")
    merged = RunOptions.merged(base, quality="lossless", offload=None, gpu_memory=None)
    assert merged == RunOptions(quality="lossless", offload="stage")
    assert RunOptions.merged(None) == RunOptions()
    with pytest.raises(TypeError, match="cache"):
        RunOptions.merged(base, cache="high")
    with pytest.raises(RequestError, match="gpu_memory"):  # the merged object is validated again
        RunOptions.merged(base, offload="layerwise")


def test_per_request_quality_fast_never_mixes_with_other_tiers():
    lossless, fast = RunOptions(), RunOptions(quality="fast")
    assert lossless.request_quality(None) == "lossless" and lossless.request_quality("exact") == "exact"
    assert fast.request_quality(None) == "fast" and fast.request_quality("fast") == "fast"
    for options, asked in ((lossless, "fast"), (fast, "exact"), (fast, "lossless")):
        with pytest.raises(RequestError, match="fast") as info:
            options.request_quality(asked)
        assert info.value.field == "quality"
    with pytest.raises(RequestError, match="quality must be one of exact, lossless, fast"):
        lossless.request_quality("best")


def _choices(parser: argparse.ArgumentParser, command: str) -> dict[str, tuple]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: tuple(a.choices) for a in sub._actions if a.choices is not None}


def test_every_face_reads_the_same_values():
    from h3gen.cli import build_parser
    from h3gen.server.schemas import GenerationBody

    parser = build_parser()
    for command in ("generate", "serve"):
        choices = _choices(parser, command)
        assert choices["quality"] == QUALITY_TIERS and choices["offload"] == OFFLOAD_MODES
        assert choices["quantization"] == QUANTIZATIONS and choices["attention"] == ATTENTION_BACKENDS
    assert _choices(parser, "serve")["workflow"] == WORKFLOWS
    assert ATTENTION_BACKENDS == BACKENDS  # the attention dispatch owns the backend names
    schema = GenerationBody.model_json_schema()["properties"]
    assert tuple(schema["quality"]["anyOf"][0]["enum"]) == QUALITY_TIERS
    assert tuple(schema["task"]["enum"]) == TASKS
    assert tuple(WORKFLOWS) == ("auto", "all", *TASKS)


def test_the_ui_task_choices_are_the_options_tasks():
    from h3gen.ui.blocks import build_ui

    manager = SimpleNamespace(engine=SimpleNamespace(planner=None), list=lambda limit: ([], None))
    demo = build_ui(manager)
    task = next(block for block in demo.blocks.values() if getattr(block, "elem_id", None) == "task")
    assert tuple(value for _, value in task.choices) == TASKS


def test_the_server_and_the_pipeline_refuse_a_tier_with_one_message(tiny_dir):
    from h3gen.server.engine import H3Engine
    from h3gen.server.schemas import GenerationBody

    engine = H3Engine(tiny_dir, device="cpu")
    with pytest.raises(RequestError) as served:
        engine.validate(GenerationBody(prompt="x", quality="fast"), {})
    with pytest.raises(RequestError) as direct:
        RunOptions().request_quality("fast")
    assert str(served.value) == str(direct.value) and served.value.field == "quality"


def test_engine_keywords_and_options_give_the_same_options(tiny_dir):
    from h3gen.server.engine import H3Engine

    old = H3Engine(
        tiny_dir,
        device="cpu",
        quality="exact",
        workflow="t2va",
        offload={"offload": "stage", "gpu_memory": None, "prefetch": 3, "quantization": None},
    )
    new = H3Engine(
        tiny_dir, device="cpu", options=RunOptions(quality="exact", workflow="t2va", offload="stage", prefetch=3)
    )
    assert old.options == new.options == RunOptions(quality="exact", offload="stage", prefetch=3, workflow="t2va")
    assert old.offload == {"offload": "stage", "gpu_memory": None, "prefetch": 3, "quantization": None}
    assert old.quality == "exact" and H3Engine(tiny_dir, device="cpu").workflow == "all"  # default: auto
    with pytest.raises(RequestError, match="gpu_memory"):
        H3Engine(tiny_dir, device="cpu", offload={"offload": "layerwise"})


def test_auto_workflow_resolves_by_the_memory_it_would_load_into(tiny_dir, monkeypatch):
    checkpoint = H3Checkpoint.open(tiny_dir)
    assert resolve_workflow(checkpoint, "t2va", "cpu") == "t2va"
    assert resolve_workflow(checkpoint, "auto", "cpu") == "all"  # the tiny partitions are small
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    assert resolve_workflow(checkpoint, "auto", "cpu") == "fl2va"


def test_placement_follows_the_offload_mode(tiny_dir, monkeypatch):
    checkpoint = H3Checkpoint.open(tiny_dir)
    folders = {name: checkpoint.folder(name) for name in ("transformer", "text_encoder", "vae", "audio_vae")}
    cuda = torch.device("cuda")
    where = {}
    for mode, extra in (("none", {}), ("stage", {}), ("layerwise", {"gpu_memory": "1GiB"})):
        placement = plan_placement(RunOptions(offload=mode, **extra), cuda, folders)
        where[mode] = (placement.transformer_device.type, placement.stage_device.type)
        assert placement.host_store("transformer") is None  # no Ulysses group
    assert where == {"none": ("cuda", "cuda"), "stage": ("cuda", "cpu"), "layerwise": ("cpu", "cpu")}
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    plan_placement(RunOptions(offload="none"), cuda, folders)  # no host copies: not checked
    with pytest.raises(CheckpointError, match="stage offload .* needs .* of host memory.*layer-wise offload"):
        plan_placement(RunOptions(offload="stage"), cuda, folders)
    with pytest.raises(CheckpointError, match="host memory"):
        plan_placement(RunOptions(offload="layerwise", gpu_memory="1GiB"), cuda, folders)
    stage_bytes = sum(host_memory.folder_bytes(folders[name]) for name in ("text_encoder", "vae", "audio_vae"))
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: stage_bytes)
    plan_placement(RunOptions(offload="stage"), cuda, folders)  # the transformer stays on the GPU: not counted
    with pytest.raises(CheckpointError, match="layer-wise offload"):
        plan_placement(RunOptions(offload="layerwise", gpu_memory="1GiB"), cuda, folders)


def test_an_attention_backend_that_cannot_run_is_refused_before_loading(tiny_dir, monkeypatch):
    from h3gen.pipelines.h3 import pipeline
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    monkeypatch.setattr(pipeline.H3Transformer, "from_pretrained", None)  # loading would fail differently
    with pytest.raises(RequestError, match="attention cudnn cannot run here: .*fp16 or bf16") as info:
        H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, attention="cudnn")
    assert info.value.field == "attention"


def test_bad_run_options_fail_before_the_checkpoint_is_read(tmp_path):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    with pytest.raises(RequestError) as info:
        H3Pipeline.from_pretrained(tmp_path / "no-such-model", offload="disk")
    assert info.value.field == "offload"


def test_cli_rejects_bad_run_options_before_loading(capsys, tmp_path):
    from h3gen.cli import main

    code = main(
        [
            "generate",
            "a cat",
            "--model",
            str(tmp_path / "no-such-model"),
            "--offload",
            "layerwise",
            "--out",
            str(tmp_path / "x.mp4"),
        ]
    )
    assert code == 2
    assert "offload='layerwise' needs gpu_memory" in capsys.readouterr().err
    code = main(
        [
            "generate",
            "a cat",
            "--model",
            str(tmp_path / "no-such-model"),
            "--quality",
            "exact",
            "--attention",
            "cudnn",
            "--out",
            str(tmp_path / "x.mp4"),
        ]
    )
    assert code == 2 and "attention cudnn cannot be combined with quality exact" in capsys.readouterr().err


def test_pipeline_keywords_options_and_attention_reach_the_blocks(tiny_dir):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    by_keywords = H3Pipeline.from_pretrained(
        tiny_dir, device="cpu", torch_dtype=torch.float32, offload="stage", prefetch=3
    )
    assert by_keywords.options == RunOptions(offload="stage", prefetch=3)
    assert by_keywords.offload == "stage" and by_keywords.quality == "lossless" and by_keywords.workflow == "t2va"
    pipe = H3Pipeline.from_pretrained(
        tiny_dir, device="cpu", torch_dtype=torch.float32, options=RunOptions(attention="math"), prefetch=1
    )
    assert pipe.options == RunOptions(attention="math", prefetch=1)  # a keyword next to options replaces its field

    def backends():
        return {block.attn.core.backend for block in pipe.transformer.transformer_blocks}

    assert backends() == {"math"}
    pipe("a cat", seed=1, num_inference_steps=2, num_frames=124, quality="exact", decode=False)
    assert backends() == {"sdpa"}  # the exact tier runs torch's SDPA choice whatever the option
    pipe("a cat", seed=1, num_inference_steps=2, num_frames=124, decode=False)
    assert backends() == {"math"}


def test_a_cuda_pipeline_takes_expandable_segments_unless_the_operator_configured_the_allocator(monkeypatch):
    from h3gen import device_memory

    applied = []
    monkeypatch.setattr(device_memory, "_set_allocator_settings", applied.append)
    for name in device_memory.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not device_memory.use_expandable_segments("cpu") and applied == []
    plan_placement(RunOptions(), torch.device("cuda"), {})
    assert applied == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert not device_memory.use_expandable_segments("cuda") and applied == ["expandable_segments:True"]
