"""FastH3 adapters (`fastvideo-lora-v2`) merged at load: the merged pipeline equals the full student built from the
same deltas (clip for clip, contract for contract), under layer-wise offload and tensor parallelism too; broken files
are refused naming the key; per-request use is refused with the way to load one."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.recipe_files import TURBO_8_768P, write_turbo
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3gen.errors import CheckpointError, RequestError
from h3gen.loading.load import meta_parameters
from h3gen.offload import host_memory
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.fasth3 import CONTRACT_SCHEMA
from h3gen.pipelines.h3.fasth3_adapter import merge_cost, read_fasth3_adapter
from h3gen.pipelines.h3.loader import transformer_host_bytes
from h3gen.pipelines.h3.pipeline import H3Pipeline
from h3gen.pipelines.h3.request import read_transformer_config
from h3gen.pipelines.h3.tiny_checkpoint import build_tiny_fasth3_adapter, build_tiny_student
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

CLIP = dict(seed=5, num_frames=130)
DENSE_CONTRACT = {
    "schema_version": CONTRACT_SCHEMA,
    "task": "t2av",
    "transformer_forwards": 4,
    "num_inference_steps": 5,
    "dmd_denoising_steps": [999, 749, 500, 250],
    "guidance_scale": 1.0,
    "attention_backend": "FLASH_ATTN",
}


def _student_weights(base, adapter_path) -> dict[str, torch.Tensor]:
    """The base transformer's tensors with the adapter's deltas applied as the format states: W + B A, then
    `.diff` / `.diff_b` added (in float32, cast once), then `.set_weight` assigned."""
    state = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))
    deltas = {}
    with safe_open(str(adapter_path), framework="pt") as handle:
        for key in handle.keys():
            deltas[key.removeprefix("transformer.")] = handle.get_tensor(key)
    out = {}
    for key, tensor in deltas.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            lora_b = deltas[f"{module}.lora_B.weight"]
            weight = out.get(f"{module}.weight", state[f"{module}.weight"].float())
            out[f"{module}.weight"] = weight + lora_b.float() @ tensor.float()
    for key, tensor in deltas.items():
        for suffix, leaf in ((".diff_b", "bias"), (".diff", "weight")):
            if key.endswith(suffix):
                target = f"{key.removesuffix(suffix)}.{leaf}"
                out[target] = out.get(target, state[target].float()) + tensor.float()
    out = {key: value.to(state[key].dtype) for key, value in out.items()}
    for key, tensor in deltas.items():
        if key.endswith(".set_weight"):
            out[f"{key.removesuffix('.set_weight')}.weight"] = tensor
    return out


@pytest.fixture(scope="module", params=["vsa", "dense"])
def student(request, tiny_dir, tmp_path_factory):
    """(kind, adapter path, full student folder) built from the same deltas."""
    gated = request.param == "vsa"
    folder = tmp_path_factory.mktemp(request.param)
    # The VSA file's keys carry the `transformer.` prefix, the dense file's none.
    adapter = build_tiny_fasth3_adapter(
        tiny_dir, folder / "adapter_model.safetensors", gates=gated, prefix="transformer." if gated else ""
    )
    full = build_tiny_student(
        tiny_dir,
        folder / "student",
        gates=gated,
        contract=None if gated else DENSE_CONTRACT,
        weights=_student_weights(tiny_dir, adapter),
    )
    return request.param, adapter, full


def _same_clip(a, b) -> None:
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio)


def test_adapter_merged_at_load_equals_the_full_student(student, tiny_dir):
    kind, adapter, full = student
    merged = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, loras=[str(adapter)])
    reference = H3Pipeline.from_pretrained(full, device="cpu", torch_dtype=torch.float32)
    assert merged.transformer.gates == (kind == "vsa")
    merged_state, full_state = merged.transformer.state_dict(), reference.transformer.state_dict()
    assert merged_state.keys() == full_state.keys()
    for key, value in full_state.items():
        assert torch.equal(merged_state[key], value), key
    assert merged.student == reference.student
    assert merged.student.sparsity == (0.9 if kind == "vsa" else None)
    assert merged.student.recipe.forwards == 4
    clip = merged("a fox in snow", **CLIP)
    assert clip.num_forwards == 4 and clip.sampling["forwards"] == 4
    assert clip.sampling["recipe"] == f"FastH3 4-step ({'VSA' if kind == 'vsa' else 'dense'})"
    assert clip.loras == [(adapter.stem, 1.0)]  # the merged student's adapter is named like any merged LoRA
    full_clip = reference("a fox in snow", **CLIP)
    assert full_clip.loras == []
    _same_clip(clip, full_clip)
    base = H3Transformer.from_pretrained(tiny_dir / "transformer", torch_dtype=torch.float32).state_dict()
    changed = [key for key, value in base.items() if not torch.equal(merged_state[key], value)]
    assert len(changed) == 52 // 2 + 11  # every low-rank target and every delta changed the base


def test_merged_student_under_layerwise_offload_equals_resident(student, tiny_dir):
    kind, adapter, _ = student
    if kind != "vsa":
        pytest.skip("the gated student covers the offload path (gates stream with their block)")
    resident = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, loras=[str(adapter)])
    offloaded = H3Pipeline.from_pretrained(
        tiny_dir, device="cpu", torch_dtype=torch.float32, loras=[str(adapter)], offload="layerwise", gpu_memory="1GiB"
    )
    assert offloaded.transformer.offload_plan is not None
    _same_clip(offloaded("a fox", **CLIP), resident("a fox", **CLIP))


def _gate_bytes(config, itemsize) -> int:
    """Bytes of the VSA gates of a model of `config`, counted on a meta-device build."""
    with meta_parameters():
        model = H3Transformer.from_config(config, gates=True)
    gates = [p for name, p in model.named_parameters() if ".attn.to_gate_compress." in name]
    assert len(gates) == config.num_layers
    return sum(p.numel() for p in gates) * itemsize


def test_released_gates_take_3_85_gb():
    assert _gate_bytes(H3TransformerConfig(), 2) == 50 * (56 * 128) * 5376 * 2


def test_the_host_copy_counts_the_gates_the_adapter_creates(tiny_dir, tmp_path):
    gated = read_fasth3_adapter(build_tiny_fasth3_adapter(tiny_dir, tmp_path / "vsa.safetensors", gates=True))
    dense = read_fasth3_adapter(build_tiny_fasth3_adapter(tiny_dir, tmp_path / "dense.safetensors", gates=False))
    folder = tiny_dir / "transformer"
    plain = transformer_host_bytes(H3Transformer, folder, torch.float32)
    gates = _gate_bytes(read_transformer_config(H3Checkpoint.open(tiny_dir)), 4)
    assert transformer_host_bytes(H3Transformer, folder, torch.float32, adapter=gated) == plain + gates
    assert transformer_host_bytes(H3Transformer, folder, torch.float32, adapter=dense) == plain


def test_layerwise_host_memory_check_counts_the_gates_the_adapter_creates(tiny_dir, tmp_path, monkeypatch):
    adapter = build_tiny_fasth3_adapter(tiny_dir, tmp_path / "fasth3.safetensors", gates=True)
    checkpoint = H3Checkpoint.open(tiny_dir)
    others = sum(host_memory.folder_bytes(checkpoint.folder(name)) for name in ("text_encoder", "vae", "audio_vae"))
    transformer = transformer_host_bytes(
        H3Transformer, checkpoint.folder("transformer"), torch.float32, adapter=read_fasth3_adapter(adapter)
    )
    gates = _gate_bytes(read_transformer_config(checkpoint), 4)
    load = dict(device="cpu", torch_dtype=torch.float32, loras=[str(adapter)], offload="layerwise", gpu_memory="1GiB")
    assert gates > 1  # the refusal below is within the gates: a check without them would let the load through
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: others + transformer - 1)
    with pytest.raises(CheckpointError, match="layer-wise offload .* needs .* of host memory"):
        H3Pipeline.from_pretrained(tiny_dir, **load)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: others + transformer)
    assert H3Pipeline.from_pretrained(tiny_dir, **load).transformer.gates


def test_a_regular_adapter_given_at_load_is_merged_and_brings_its_recipe(tiny_dir, tmp_path):
    turbo = write_turbo(tmp_path, tiny_dir)
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, loras=[(str(turbo), 1.0)])
    assert pipe.student is None
    clip = pipe("a fox", **CLIP)
    assert clip.num_forwards == 8 and clip.loras == [(TURBO_8_768P.removesuffix(".safetensors"), 1.0)]


def test_fasth3_adapter_per_request_is_refused_with_how_to_load_it(tiny_dir, tmp_path):
    adapter = build_tiny_fasth3_adapter(tiny_dir, tmp_path / "fasth3.safetensors")
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    for attempt in (lambda: pipe("a fox", loras=[str(adapter)], **CLIP), lambda: pipe.load_lora(adapter)):
        with pytest.raises(
            RequestError, match=r"merged when the model loads.*from_pretrained\(model, loras=\[path\]\)"
        ):
            attempt()


def test_two_fasth3_adapters_or_a_strength_are_refused(tiny_dir, tmp_path):
    adapter = str(build_tiny_fasth3_adapter(tiny_dir, tmp_path / "fasth3.safetensors"))
    with pytest.raises(RequestError, match="two FastH3 adapters"):
        H3Pipeline.from_pretrained(tiny_dir, device="cpu", loras=[adapter, adapter])
    with pytest.raises(RequestError, match="scale 1"):
        H3Pipeline.from_pretrained(tiny_dir, device="cpu", loras=[(adapter, 0.5)])


def test_an_adapter_on_a_student_checkpoint_is_refused(student, tiny_dir):
    kind, adapter, full = student
    match = "holds VSA gates already" if kind == "vsa" else "FastH3 student already"
    with pytest.raises(CheckpointError, match=match):
        H3Pipeline.from_pretrained(full, device="cpu", loras=[str(adapter)])


def _edited(tiny_dir, path, edit, *, gates=True):
    """The tiny adapter with `edit(tensors, metadata)` applied, at `path`."""
    build_tiny_fasth3_adapter(tiny_dir, path, gates=gates)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    edit(tensors, metadata)
    for field in ("low_rank_tensors", "set_weight_tensors"):
        metadata.pop(field)
    save_file(tensors, str(path), metadata=metadata)
    return path


def _rename(old, new):
    def edit(tensors, metadata):
        tensors[new] = tensors.pop(old)

    return edit


def _add(key, shape):
    def edit(tensors, metadata):
        tensors[key] = torch.zeros(shape)

    return edit


def _drop(key):
    def edit(tensors, metadata):
        del tensors[key]

    return edit


def _reshape_b(tensors, metadata):
    key = "transformer_blocks.1.ff.net.2.lora_B.weight"
    tensors[key] = torch.zeros(tensors[key].shape[0] + 8, tensors[key].shape[1])


BAD_FILES = {
    "unknown module": (_add("transformer_blocks.0.attn.norm_q.diff", (32,)), "attn.norm_q`, which is not a module"),
    "set_weight off the gates": (_add("proj_in.set_weight", (64, 96)), "may only create a transformer block's VSA"),
    "diff into the fused qkv": (_add("blocks.0.attn.qkv_proj.diff", (192, 64)), "original release's module"),
    "missing parameter": (
        _add("token_refiner.refiner_blocks.0.adaln_proj.linear.diff_b", (1152,)),
        "which the model does not have",
    ),
    "shape mismatch": (_reshape_b, r"makes a 72 x 128 update, but the model's tensor is 64 x 128"),
    "gate missing in a block": (
        _drop("transformer_blocks.1.attn.to_gate_compress.set_weight"),
        r"gate of 1 of the model's 2 blocks; `transformer_blocks.1.attn.to_gate_compress.set_weight` is missing",
    ),
    "factor without its pair": (_drop("transformer_blocks.0.attn.to_q.lora_B.weight"), "has no lora_B beside it"),
    "unknown key kind": (
        _rename("transformer_blocks.1.attn.to_q.lora_A.weight", "transformer_blocks.1.attn.to_q.lora_X"),
        "none of lora_A",
    ),
    "another format": (lambda tensors, metadata: metadata.update(format="peft"), "not 'fastvideo-lora-v2'"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_broken_adapters_are_refused_naming_the_key(case, tiny_dir, tmp_path):
    edit, message = BAD_FILES[case]
    path = _edited(tiny_dir, tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        H3Transformer.from_pretrained(tiny_dir / "transformer", adapter=read_fasth3_adapter(path))
    assert str(tmp_path) not in str(caught.value)


def test_a_block_without_updates_and_a_short_count_are_refused(tiny_dir, tmp_path):
    def drop_block(tensors, metadata):
        for key in [k for k in tensors if k.startswith("token_refiner.refiner_blocks.1.") and "lora_" in k]:
            del tensors[key]

    path = _edited(tiny_dir, tmp_path / "a.safetensors", drop_block)
    with pytest.raises(CheckpointError, match=r"leaves token_refiner.refiner_blocks.1 without low-rank updates"):
        H3Transformer.from_pretrained(tiny_dir / "transformer", adapter=read_fasth3_adapter(path))
    path = build_tiny_fasth3_adapter(tiny_dir, tmp_path / "b.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = dict(handle.metadata()), {key: handle.get_tensor(key) for key in handle.keys()}
    del tensors["transformer_blocks.0.ff.net.2.lora_A.weight"], tensors["transformer_blocks.0.ff.net.2.lora_B.weight"]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"states low_rank_tensors=52 but it holds 50"):
        read_fasth3_adapter(path)


def test_merge_cost_counts_the_products(tiny_dir, tmp_path):
    adapter = read_fasth3_adapter(build_tiny_fasth3_adapter(tiny_dir, tmp_path / "a.safetensors", rank=8))
    cost = merge_cost(adapter)
    assert json.dumps(adapter.describe())  # JSON-able, no path
    assert cost["flops"] > 0 and cost["elements"] > 0
    assert adapter.describe()["low_rank"] == 52 and adapter.describe()["set_weight"] == 2


# ---------------------------------------------------------------- tensor parallel (gloo, 2 processes)


def _tp_worker(rank, world, init_file, folder, adapter_path, result_dir):
    from helpers.parallel_model import join_gloo

    from h3gen.parallel import init_parallel

    join_gloo(rank, world, init_file)
    try:
        state = init_parallel(2, 1, 2)
        for quantization in (None, "mxfp4"):
            model = H3Transformer.from_pretrained(
                folder,
                torch_dtype=torch.float32,
                parallel=state,
                quantization=quantization,
                adapter=read_fasth3_adapter(adapter_path),
            )
            torch.save(model.state_dict(), os.path.join(result_dir, f"{quantization}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_their_shards_of_the_merged_model(student, tiny_dir, tmp_path):
    """Each TP rank merges only its slice of every update (B's rows on column shards, A's columns on row shards,
    read lazily) and holds exactly its shard of the one-process merged model, dense and MXFP4."""
    kind, adapter, _ = student
    if kind != "vsa":
        pytest.skip("the gated student covers the gate's column shards")
    folder = tiny_dir / "transformer"
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "init"), str(folder), str(adapter), str(tmp_path)), nprocs=2)
    for quantization in (None, "mxfp4"):
        whole = H3Transformer.from_pretrained(
            folder, torch_dtype=torch.float32, quantization=quantization, adapter=read_fasth3_adapter(adapter)
        ).state_dict()
        for rank in range(2):
            shards = torch.load(tmp_path / f"{quantization}-{rank}.pt")
            assert any("to_gate_compress" in key for key in shards)
            for key, shard in shards.items():
                full = whole[key]
                if shard.shape == full.shape:
                    expected = full
                elif shard.shape[0] * 2 == full.shape[0]:  # column-parallel rows (SwiGLU: per half)
                    parts = full.chunk(2 if ".ff.net.0." in key else 1, dim=0)
                    expected = torch.cat([p.chunk(2, dim=0)[rank] for p in parts])
                else:  # row-parallel columns
                    expected = full.chunk(2, dim=-1)[rank]
                assert torch.allclose(shard.float(), expected.float(), rtol=0, atol=1e-6), (quantization, rank, key)


# ---------------------------------------------------------------- command line


def test_merge_lora_flag_on_generate_serve_and_worker():
    from h3gen.cli import build_parser

    for command in (
        ["generate", "x", "--out", "o.mp4"],
        ["serve"],
        ["worker", "--store", "s", "--results-dir", "r"],
    ):
        args = build_parser().parse_args([*command, "--merge-lora", "a.safetensors", "--merge-lora", "b.safetensors"])
        assert args.merge_loras == ["a.safetensors", "b.safetensors"], command[0]
        assert build_parser().parse_args(command).merge_loras is None


def test_local_workers_merge_the_same_adapters(tmp_path):
    from h3gen.cli import build_parser
    from h3gen.server.local_workers import worker_command

    args = build_parser().parse_args(["serve", "--results-dir", str(tmp_path), "--merge-lora", "a.safetensors"])
    command = worker_command(args, 0)
    assert command[command.index("--merge-lora") + 1] == os.path.abspath("a.safetensors")


@pytest.mark.slow
@pytest.mark.server
def test_generate_with_merge_lora_runs_the_student_contract(student, tiny_dir, tmp_path):
    import sys

    from helpers.server_harness import run_isolated

    kind, adapter, _ = student
    if kind != "vsa":
        pytest.skip("one end-to-end run covers the flag")
    out = tmp_path / "student.mp4"
    command = ["generate", "a fox", "--model", str(tiny_dir), "--seed", "2", "--merge-lora", str(adapter)]
    result = run_isolated(
        [sys.executable, "-m", "h3gen.cli", *command, "--out", str(out)],
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 transformer forwards (5 sigma points), shifts 12/3, recipe FastH3 4-step (VSA)" in result.stderr
    refused = run_isolated(
        [sys.executable, "-m", "h3gen.cli", "generate", "a fox", "--model", str(tiny_dir), "--lora", str(adapter)]
        + ["--out", str(tmp_path / "x.mp4")],
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert refused.returncode != 0 and "--merge-lora PATH" in refused.stderr
