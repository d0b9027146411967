"""Layer-wise and stage offload on the CPU: outputs bit-identical to no offload, planner decisions, prefetch order,
and the host-memory refusal. (The overlap of copies and compute is measured on the GPU: bench_offload.py.)"""

import numpy as np
import pytest
import torch
from helpers.h3_tiny import TINY_CONFIGS, random_inputs, randomize_

from h3gen.errors import CheckpointError, RequestError
from h3gen.offload import apply_layerwise_offload, plan_residency
from h3gen.offload.host_memory import check_host_memory
from h3gen.offload.residency import GiB, parse_bytes, spread
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer

# Whole pipelines under every offload mode, and ranks sharing one host store: outside the fast tier.
pytestmark = pytest.mark.slow

CONFIG = dict(TINY_CONFIGS[2], num_layers=6)
INPUTS = dict(num_text=6, latent_frames=3, latent_hw=(4, 2), audio_latents=7, anchors=("first",), distinct_timesteps=3)


def _block_bytes(model):
    return sum(
        p.numel() * p.element_size()
        for n, p in model.transformer_blocks[0].named_parameters()
        if not n.startswith("adaln_proj")
    )


def _other_bytes(model):
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("transformer_blocks.")
    )


@pytest.mark.parametrize("tier", ["exact", "lossless"])
@pytest.mark.parametrize("resident_blocks,prefetch", [(0, 1), (2, 2), (3, 1)])
def test_offloaded_transformer_is_bit_identical(tier, resident_blocks, prefetch):
    reference = H3Transformer.from_config(CONFIG).eval()
    randomize_(reference, seed=5)
    set_quality(reference, tier)
    model = H3Transformer.from_config(CONFIG).eval()
    model.load_state_dict(reference.state_dict())
    set_quality(model, tier)
    log = []
    budget = _other_bytes(model) + (resident_blocks + prefetch + 1) * _block_bytes(model)
    apply_layerwise_offload(model, "cpu", gpu_memory=budget, activation_reserve=0, prefetch=prefetch, copy_log=log)
    plan = model.offload_plan
    assert len(plan.resident) == resident_blocks and len(plan.streamed) == 6 - resident_blocks
    for step in range(3):  # the stream wraps from one step into the next
        inputs = random_inputs(CONFIG, seed=step, **INPUTS)
        extra = {}
        if tier == "lossless":
            extra = dict(adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0)
        with torch.no_grad():
            expected = reference(**inputs, return_dict=False)
            got = model(**inputs, return_dict=False, **extra)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    streamed = list(plan.streamed)
    # Copies in forward order, `prefetch` ahead, continuing across steps.
    assert log[: 3 * len(streamed)] == streamed * 3
    assert len(log) == 3 * len(streamed) + prefetch
    # Streamed blocks hold no weights between uses; resident ones hold theirs, but not the AdaLN projection the
    # budget left out (it is copied in when called).
    block = model.transformer_blocks[streamed[0]]
    assert block.attn.to_q.weight.numel() == 0 and block.adaln_proj.linear.weight.numel() == 0
    for index in plan.resident:
        block = model.transformer_blocks[index]
        assert block.attn.to_q.weight.numel() > 0 and block.adaln_proj.linear.weight.numel() == 0


def test_planner_decisions():
    blocks = [100] * 10
    assert plan_residency(blocks, 1000).resident == tuple(range(10))  # everything fits: nothing streams
    plan = plan_residency(blocks, 700, prefetch=2)  # ring of 3 buffers + 4 resident blocks
    assert plan.slots == 3 and len(plan.resident) == 4 and plan.resident == tuple(spread(4, 10))
    assert plan.resident == (0, 2, 5, 8) and plan.gpu_bytes == 700
    leading = plan_residency(blocks, 700, prefetch=2, policy="leading")
    assert leading.resident == (0, 1, 2, 3) and leading.streamed == (4, 5, 6, 7, 8, 9)
    assert plan_residency(blocks, 250, prefetch=1).resident == ()  # just the ring of 2
    with pytest.raises(RequestError, match="needs 300 B|needs 0.0 MiB|prefetch 2 needs"):
        plan_residency(blocks, 250, prefetch=2)
    with pytest.raises(RequestError, match="prefetch must be at least 1"):
        plan_residency(blocks, 250, prefetch=0)
    assert parse_bytes("30GiB") == 30 * GiB and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(RequestError, match="gpu_memory must look like"):
        parse_bytes("lots")


def test_host_memory_refusal_is_clear(monkeypatch, tmp_path):
    with pytest.raises(CheckpointError, match=r"needs 80.0 GiB of host memory but only 24.0 GiB is available"):
        check_host_memory(80 * GiB, "layer-wise offload", available_bytes=24 * GiB)
    check_host_memory(1 * GiB, "layer-wise offload", available_bytes=24 * GiB)  # fits: no error

    from h3gen.offload import host_memory
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1024)
    with pytest.raises(CheckpointError, match="layer-wise offload .* needs .* of host memory"):
        H3Pipeline.from_pretrained(
            tiny_checkpoint(cache_dir=tmp_path), device="cpu", offload="layerwise", gpu_memory="1GiB"
        )


@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.bfloat16])
def test_layerwise_host_memory_check_sizes_the_transformer_as_loaded(tiny_dir, monkeypatch, torch_dtype):
    """MXFP4 at load keeps the blocks packed on the host: the check counts that size, not the files', so a machine
    with room for the packed copy loads; the estimate is the resident model's bytes."""
    from h3gen.offload import host_memory
    from h3gen.pipelines.h3.checkpoint import H3Checkpoint
    from h3gen.pipelines.h3.loader import transformer_host_bytes
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    checkpoint = H3Checkpoint.open(tiny_dir)
    folder = checkpoint.folder("transformer")
    others = sum(host_memory.folder_bytes(checkpoint.folder(name)) for name in ("text_encoder", "vae", "audio_vae"))
    packed = transformer_host_bytes(H3Transformer, folder, torch_dtype, "mxfp4")
    assert packed < transformer_host_bytes(H3Transformer, folder, torch_dtype) <= host_memory.folder_bytes(folder)
    load = dict(device="cpu", torch_dtype=torch_dtype, offload="layerwise", gpu_memory="1GiB", quantization="mxfp4")
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: others + packed - 1)
    with pytest.raises(CheckpointError, match="layer-wise offload .* needs .* of host memory"):
        H3Pipeline.from_pretrained(tiny_dir, **load)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: others + packed)
    offloaded = H3Pipeline.from_pretrained(tiny_dir, **load).transformer
    resident = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch_dtype, quantization="mxfp4")

    def nbytes(model):
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())

    assert nbytes(resident.transformer) == packed
    assert nbytes(offloaded) <= packed  # offload drops the AdaLN projections once their tables are built


def test_pipeline_offload_modes_give_the_same_clip(tmp_path):
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    folder = tiny_checkpoint(cache_dir=tmp_path)
    kwargs = dict(seed=2, num_inference_steps=3, num_frames=130)
    plain_pipe = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)
    plain = plain_pipe("a fox", **kwargs)
    # The tiny model has 2 blocks, so a 2-slot ring is as large as keeping both: the plan keeps them (streaming
    # itself is checked on a 6-block transformer above).
    transformer = plain_pipe.transformer
    budget = int((_other_bytes(transformer) + 2 * _block_bytes(transformer)) / 0.8) + 1
    for mode, extra in (("stage", {}), ("layerwise", {"gpu_memory": budget, "prefetch": 1})):
        pipe = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32, offload=mode, **extra)
        clip = pipe("a fox", **kwargs)
        assert np.array_equal(clip.video, plain.video) and np.array_equal(clip.audio, plain.audio), mode
    assert pipe.transformer.offload_plan.resident == (0, 1)
    with pytest.raises(RequestError, match="gpu_memory"):
        H3Pipeline.from_pretrained(folder, device="cpu", offload="layerwise")


def test_streamed_text_encoder_layers_give_the_same_conditioning(tmp_path):
    from h3gen.offload import stream_layers
    from h3gen.pipelines.h3.text_encoder import H3TextEncoder
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    folder = tiny_checkpoint(cache_dir=tmp_path)

    def load():
        return H3TextEncoder.from_pretrained(
            folder / "text_encoder", folder / "tokenizer", None, dtype=torch.float32, device="cpu"
        )

    expected = load().encode("a quiet street at night").embeds
    encoder = load()
    log = []
    stream_layers(encoder.model.model.language_model.layers, "cpu", prefetch=2, copy_log=log)
    for _ in range(2):
        assert torch.equal(encoder.encode("a quiet street at night").embeds, expected)
    assert log[:51] == list(range(51)) and log[51:102] == list(range(51))  # every layer, in order, each call


def test_mxfp4_blocks_stream_their_packed_bytes_bit_identically():
    from h3gen.linear import make_linear_factory
    from h3gen.quant.mxfp4 import MXFP4Linear

    dense = H3Transformer.from_config(CONFIG).eval()
    randomize_(dense, seed=7)

    def quantized_copy():
        model = H3Transformer.from_config(CONFIG, linear_factory=make_linear_factory(quantization="mxfp4")).eval()
        state = dense.state_dict()
        for name, module in model.named_modules():
            if isinstance(module, MXFP4Linear):
                module.set_weight(state.pop(f"{name}.weight"))
                module.compute_dtype = torch.float32
        model.load_state_dict(state, strict=False)
        set_quality(model, "lossless")
        return model

    reference, model = quantized_copy(), quantized_copy()
    from h3gen.offload.layerwise import owned_tensors

    block_bytes = sum(
        t.numel() * t.element_size() for *_, t in owned_tensors(model.transformer_blocks[0], ("adaln_proj",))
    )
    dense_block_bytes = _block_bytes(dense)
    budget = _other_bytes(model) + 3 * block_bytes  # 2 ring slots and one resident block
    log = []
    offload = apply_layerwise_offload(model, "cpu", gpu_memory=budget, activation_reserve=0, prefetch=1, copy_log=log)
    assert len(model.offload_plan.streamed) == 5
    # Per streamed block, the packed weights (plus float32 norms and biases) instead of the float32 matrices.
    streamed_bytes = sum(packed.nbytes for packed in offload.packed.values())
    assert streamed_bytes < 5 * dense_block_bytes / 4, (streamed_bytes, dense_block_bytes)
    for step in range(2):
        inputs = random_inputs(CONFIG, seed=10 + step, **INPUTS)
        with torch.no_grad():
            expected = reference(
                **inputs, return_dict=False, adaln_tables=reference.precompute_adaln([inputs["timestep"]]), step=0
            )
            got = model(**inputs, return_dict=False, adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    assert log[:10] == list(model.offload_plan.streamed) * 2


def test_local_ranks_share_one_host_copy_that_only_rank_0_loads(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from h3gen.offload.layerwise import owned_tensors

    reference = H3Transformer.from_config(CONFIG).eval()
    randomize_(reference, seed=11)
    reference.save_pretrained(tmp_path / "transformer")
    set_quality(reference, "lossless")
    block_bytes = sum(
        t.numel() * t.element_size() for *_, t in owned_tensors(reference.transformer_blocks[0], ("adaln_proj",))
    )
    budget = _other_bytes(reference) + 4 * block_bytes  # 2 ring slots, 2 resident blocks
    store = tmp_path / "shm"
    store.mkdir()
    tests = Path(__file__).parent
    env = dict(
        os.environ, LOCAL_WORLD_SIZE="2", PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    )
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(tests / "shared_store_rank.py"),
                str(tmp_path / "transformer"),
                str(store),
                str(tmp_path / f"rank{rank}.pt"),
                str(budget),
            ],
            env=dict(env, LOCAL_RANK=str(rank)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]  # the reader starts first and waits for the owner
    for process in ranks:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
    owner, reader = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    assert owner["loaded_blocks"] and not reader["loaded_blocks"]  # the reader never read the blocks
    assert len(owner["resident"]) == 2 and owner["resident"] == reader["resident"]
    assert owner["store_bytes"] == reader["store_bytes"] >= 6 * block_bytes
    assert list(store.iterdir()) == []  # unlinked once both ranks mapped it
    for step in range(2):
        inputs = random_inputs(CONFIG, seed=step, **INPUTS)
        with torch.no_grad():
            expected = reference(**inputs, return_dict=False)
        for rank in (owner, reader):
            for got, want in zip(rank["outputs"][step], expected, strict=True):
                assert torch.equal(got, want)
