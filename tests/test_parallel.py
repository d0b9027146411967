"""Tensor parallel x Ulysses sequence parallel on CPU with gloo: 2 and 4 processes give the single-process
transformer output, each rank holds 1/TP of the sharded weights, and invalid degrees are refused up front."""

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.h3_tiny import TINY_CONFIGS, max_rel_err, random_inputs, randomize_

from h3gen.errors import RequestError
from h3gen.parallel.state import check_degrees, valid_degrees
from h3gen.pipelines.h3.tiers import set_quality

# Spawns 2-4 gloo processes per test: outside the fast tier.
pytestmark = pytest.mark.slow

CONFIG = dict(TINY_CONFIGS[2])  # 4 heads: splits as TP2, SP2, SP4 and TP2 x SP2
CASES = {2: [(2, 1), (1, 2)], 4: [(1, 4), (2, 2)]}
SECOND_CONFIG = dict(TINY_CONFIGS[0])  # 2 heads x 32, other widths: TP2 and SP2
# Odd row counts: 6 text + 8 keyframe + 2 * 7 audio + 3 * 8 video = 52 rows... plus one more text row: 53.
INPUTS = dict(num_text=7, latent_frames=3, latent_hw=(4, 4), audio_latents=7, anchors=("first",), distinct_timesteps=3)


def _worker(rank, world, init_file, payload_path, result_dir, config=CONFIG):
    from helpers.parallel_model import join_gloo, load_full_state_dict, parallel_transformer

    from h3gen.parallel import init_parallel
    from h3gen.pipelines.h3.tiers import set_quality
    from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

    join_gloo(rank, world, init_file)
    payload = torch.load(payload_path)
    results = []
    try:
        for tp, sp in CASES[world]:
            state = init_parallel(tp, sp, config["num_attention_heads"])
            model = parallel_transformer(H3TransformerConfig(**config), state).eval()
            load_full_state_dict(model, payload["state_dict"])
            outputs = {}
            for tier in ("exact", "lossless"):
                set_quality(model, tier)
                kwargs = dict(payload["inputs"])
                if tier == "lossless":
                    kwargs.update(adaln_tables=model.precompute_adaln([kwargs["timestep"]]), step=0)
                with torch.no_grad():
                    outputs[tier] = model(**kwargs, return_dict=False)
            linear_bytes = sum(
                p.numel() * p.element_size()
                for n, p in model.named_parameters()
                if n.startswith("transformer_blocks.") and p.ndim == 2
            )
            set_quality(model, "fast")  # last: it quantizes each rank's shard to FP8 in place
            kwargs = dict(
                payload["inputs"], adaln_tables=model.precompute_adaln([payload["inputs"]["timestep"]]), step=0
            )
            with torch.no_grad():
                fast = model(**kwargs, return_dict=False)
            # The same rank loaded from the checkpoint files: each rank reads its own shard.
            from h3gen.pipelines.h3.transformer import H3Transformer

            loaded = H3Transformer.from_pretrained(payload["folder"], torch_dtype=torch.float32, parallel=state)
            set_quality(loaded, "exact")
            with torch.no_grad():
                outputs["loaded from files"] = loaded(**payload["inputs"], return_dict=False)
            # MXFP4: quantized from the bf16 files shard by shard, and cut from a checkpoint saved quantized.
            mxfp4 = {}
            for name, folder, quantization in (
                ("online", payload["folder"], "mxfp4"),
                ("saved", payload["mxfp4_folder"], None),
            ):
                quantized = H3Transformer.from_pretrained(
                    folder, torch_dtype=torch.float32, parallel=state, quantization=quantization
                )
                with torch.no_grad():
                    mxfp4[name] = quantized(**payload["inputs"], return_dict=False)
            results.append(
                {"tp": tp, "sp": sp, "outputs": outputs, "linear_bytes": linear_bytes, "fast": fast, "mxfp4": mxfp4}
            )
    finally:
        torch.save(results, os.path.join(result_dir, f"{rank}.pt"))
        dist.destroy_process_group()


def _reference(folder, config):
    from h3gen.pipelines.h3.transformer import H3Transformer

    model = H3Transformer.from_config(config).eval()
    randomize_(model, seed=11)
    inputs = random_inputs(config, seed=12, **INPUTS)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
    full_linear_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("transformer_blocks.") and p.ndim == 2
    )
    fast = copy.deepcopy(model)
    set_quality(fast, "fast")
    with torch.no_grad():
        expected_fast = fast(
            **inputs, adaln_tables=fast.precompute_adaln([inputs["timestep"]]), step=0, return_dict=False
        )
    model.save_pretrained(folder / "checkpoint", max_shard_bytes=200_000)
    quantized = H3Transformer.from_pretrained(folder / "checkpoint", torch_dtype=torch.float32, quantization="mxfp4")
    quantized.save_pretrained(folder / "mxfp4")
    with torch.no_grad():
        expected_mxfp4 = quantized(**inputs, return_dict=False)
    payload = folder / "payload.pt"
    torch.save(
        {
            "state_dict": model.state_dict(),
            "inputs": inputs,
            "folder": str(folder / "checkpoint"),
            "mxfp4_folder": str(folder / "mxfp4"),
        },
        payload,
    )
    return payload, expected, full_linear_bytes, inputs["position_ids"].shape[0], expected_fast, expected_mxfp4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("parallel"), CONFIG)


@pytest.mark.parametrize(
    "world,config",
    [(2, CONFIG), (4, CONFIG), (2, SECOND_CONFIG)],
    ids=["world2-4heads", "world4-4heads", "world2-2heads"],
)
def test_tp_and_ulysses_match_one_process(world, config, tmp_path):
    payload, expected, full_linear_bytes, rows, expected_fast, expected_mxfp4 = _reference(
        tmp_path / "reference", config
    )
    assert rows % 4 and rows % 2  # odd: the sequence must be padded for SP2 and SP4
    mp.spawn(
        _worker, args=(world, str(tmp_path / "init"), str(payload), str(tmp_path), config), nprocs=world, join=True
    )
    for rank in range(world):
        results = torch.load(tmp_path / f"{rank}.pt")
        assert [(r["tp"], r["sp"]) for r in results] == CASES[world]
        for result in results:
            for tier, (video, audio) in result["outputs"].items():
                assert video.shape == expected[0].shape and audio.shape == expected[1].shape
                assert max_rel_err(video, expected[0]) <= 1e-5, (result["tp"], result["sp"], tier)
                assert max_rel_err(audio, expected[1]) <= 1e-5, (result["tp"], result["sp"], tier)
            # The fast tier under TP quantizes each rank's shard (row-parallel inputs get per-shard row scales):
            # as close to the one-process fast output as FP8 rounding allows, and as close to exact as it is.
            for got, want, exact in zip(result["fast"], expected_fast, expected, strict=True):
                one_process_error = max_rel_err(want, exact)
                if result["tp"] == 1:  # Ulysses alone: the same FP8 numbers as one process
                    assert max_rel_err(got, want) <= 1e-5
                assert 1e-3 < max_rel_err(got, exact) <= 1.3 * one_process_error, (result["tp"], result["sp"])
            # MXFP4 shards give the one-process MXFP4 output, quantized online or loaded packed (CONFIG's
            # row-parallel cuts fall inside 32-element blocks, SECOND_CONFIG's on block edges).
            for name, outputs in result["mxfp4"].items():
                for got, want, exact in zip(outputs, expected_mxfp4, expected, strict=True):
                    assert max_rel_err(got, want) <= 1e-5, (result["tp"], result["sp"], name)
                    assert max_rel_err(got, exact) > 1e-4  # MXFP4 really ran
            # Each rank keeps 1/TP of the block linears (all of them sharded here, the AdaLN projection included).
            assert result["linear_bytes"] == pytest.approx(full_linear_bytes / result["tp"], rel=1e-6)


def test_invalid_degrees_are_refused_with_the_valid_ones():
    # The released model: 56 heads on 8 GPUs.
    assert valid_degrees(56, 8) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert valid_degrees(56, 7) == [(1, 7), (7, 1)]
    with pytest.raises(RequestError) as info:
        check_degrees(56, 3, 1)  # 56 heads split over no 3-process grid
    assert "use one that divides the heads: 1, 2, 4, 7, 8, 14, 28, 56" in str(info.value)
    assert info.value.field == "parallel"
    with pytest.raises(RequestError, match="Valid here: --tp 1 --ulysses 4, --tp 2 --ulysses 2, --tp 4 --ulysses 1"):
        check_degrees(4, 2, 1, world=4)  # tp x ulysses must cover every process
    with pytest.raises(RequestError, match="Valid here: --tp 1 --ulysses 8, --tp 2 --ulysses 4"):
        check_degrees(56, 2, 2, world=8)  # 2 x 2 does not cover 8 processes


def test_a_tensor_parallel_rank_reads_only_its_shard(reference, monkeypatch):
    import h3gen.pipelines.h3.loader as loader
    from h3gen.parallel.state import ParallelState
    from h3gen.pipelines.h3.transformer import H3Transformer

    payload, *_ = reference
    full = torch.load(payload)
    calls = []
    original = loader.read_tensors
    monkeypatch.setattr(loader, "read_tensors", lambda folder, lazy=False: calls.append(lazy) or original(folder, lazy))
    state = ParallelState(tp=2, sp=1, tp_rank=1, sp_rank=0)  # loading needs no process group
    model = H3Transformer.from_pretrained(full["folder"], torch_dtype=torch.float32, parallel=state)
    assert calls == [True]  # lazy safetensors slices: only the indexed rows / columns are read
    up = model.transformer_blocks[1].ff.net[0].proj.weight
    ffn = CONFIG["ffn_dim"]
    expected = full["state_dict"]["transformer_blocks.1.ff.net.0.proj.weight"]
    assert torch.equal(up, torch.cat([expected[ffn // 2 : ffn], expected[ffn + ffn // 2 :]]))  # value and gate halves
    down = model.transformer_blocks[0].attn.to_out[0].weight
    assert torch.equal(down, full["state_dict"]["transformer_blocks.0.attn.to_out.0.weight"][:, 48:])


def _pipeline_worker(rank, world, init_file, model_dir, result_dir):
    from helpers.parallel_model import join_gloo

    from h3gen.parallel import init_parallel
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    join_gloo(rank, world, init_file)
    try:
        clips = []
        for tp, sp in ((1, world), (world, 1)):  # the tiny model has 2 heads: Ulysses 2, then TP 2
            state = init_parallel(tp, sp, 2)
            pipe = H3Pipeline.from_pretrained(model_dir, device="cpu", torch_dtype=torch.float32, parallel=state)
            output = pipe("a cat on a piano", seed=4, num_inference_steps=3, num_frames=130, decode=rank == 0)
            clips.append({"tp": tp, "sp": sp, "video": output.video, "audio": output.audio})
        torch.save(clips, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_pipeline_under_ulysses_gives_the_single_process_clip(tmp_path):
    import numpy as np

    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

    model_dir = tiny_checkpoint(cache_dir=tmp_path / "cache")
    single = H3Pipeline.from_pretrained(model_dir, device="cpu", torch_dtype=torch.float32)(
        "a cat on a piano", seed=4, num_inference_steps=3, num_frames=130
    )
    mp.spawn(_pipeline_worker, args=(2, str(tmp_path / "init"), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    clips = torch.load(tmp_path / "0.pt", weights_only=False)
    assert [(c["tp"], c["sp"]) for c in clips] == [(1, 2), (2, 1)]
    for clip in clips:
        assert np.abs(clip["video"] - single.video).max() <= 1e-4
        assert np.abs(clip["audio"] - single.audio).max() <= 1e-4
    assert all(c["video"] is None for c in torch.load(tmp_path / "1.pt", weights_only=False))  # rank 1 skips decoding


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_original_layout_is_read_shard_by_shard(reference, tmp_path, qkv_layout):
    import json

    from safetensors.torch import save_file

    from h3gen.parallel.state import ParallelState
    from h3gen.parallel.tp_linear import ColumnParallelLinear
    from h3gen.pipelines.h3.layouts import to_original_layout
    from h3gen.pipelines.h3.transformer import H3Transformer

    payload, *_ = reference
    full = torch.load(payload)["state_dict"]
    original = to_original_layout(full, CONFIG["num_attention_heads"], CONFIG["attention_head_dim"], qkv_layout)
    save_file(original, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    for rank in range(2):
        state = ParallelState(tp=2, sp=1, tp_rank=rank, sp_rank=0)
        model = H3Transformer.from_pretrained(
            tmp_path, torch_dtype=torch.float32, parallel=state, qkv_layout=qkv_layout
        )
        for name, param in model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            expected = module.load_shard(leaf, full[name]) if hasattr(module, "load_shard") else full[name]
            assert torch.equal(param, expected), name
        assert isinstance(model.transformer_blocks[0].attn.to_q, ColumnParallelLinear)


def test_mxfp4_linears_are_sharded_under_tensor_parallelism(reference, tmp_path):
    from h3gen.parallel import tp_linear
    from h3gen.parallel.state import ParallelState
    from h3gen.pipelines.h3.transformer import H3Transformer
    from h3gen.quant.mxfp4 import MXFP4Linear

    state = ParallelState(tp=2, sp=1, tp_rank=1, sp_rank=0)
    second = torch.load(_reference(tmp_path, SECOND_CONFIG)[0])["folder"]  # 64 wide, 2 x 32 heads, FFN 128
    whole = H3Transformer.from_pretrained(second, torch_dtype=torch.float32, quantization="mxfp4")
    model = H3Transformer.from_pretrained(second, torch_dtype=torch.float32, parallel=state, quantization="mxfp4")
    block, full = model.transformer_blocks[0], whole.transformer_blocks[0]
    assert isinstance(full.attn.to_q, MXFP4Linear)
    for layer in (block.attn.to_q, block.ff.net[0].proj, block.adaln_proj.linear):
        assert isinstance(layer, tp_linear.ColumnParallelMXFP4Linear)
    for layer in (block.attn.to_out[0], block.ff.net[2]):
        assert isinstance(layer, tp_linear.RowParallelMXFP4Linear)
    # Rank 1's shard is the second half of the whole layer's packed rows / columns: quantizing the shard equals
    # cutting the quantized whole (blocks of 32 along the input never straddle a cut).
    assert torch.equal(block.attn.to_q.weight_packed, full.attn.to_q.weight_packed[32:])
    assert torch.equal(block.attn.to_out[0].weight_packed, full.attn.to_out[0].weight_packed[:, 16:])
    assert torch.equal(block.ff.net[2].weight_scale, full.ff.net[2].weight_scale[:, 2:])

    # CONFIG's row-parallel inputs (96 attention channels, FFN 100) split into 48 and 50: cuts inside blocks, so
    # each rank holds the blocks covering its columns (rank 1 of 96: columns 48-95, blocks 1-2).
    payload, *_ = reference
    folder = torch.load(payload)["folder"]
    whole = H3Transformer.from_pretrained(folder, torch_dtype=torch.float32, quantization="mxfp4")
    model = H3Transformer.from_pretrained(folder, torch_dtype=torch.float32, parallel=state, quantization="mxfp4")
    to_out, full = model.transformer_blocks[0].attn.to_out[0], whole.transformer_blocks[0].attn.to_out[0]
    assert isinstance(to_out, tp_linear.RowParallelMXFP4Linear) and (to_out.offset, to_out.columns) == (16, 48)
    assert torch.equal(to_out.weight_packed, full.weight_packed[:, 16:48])
    x = torch.randn(5, 48)  # this rank's columns; the other rank's partial product added gives the whole layer
    assert to_out._local(x, None).shape == (5, CONFIG["hidden_size"])
    expected = full(torch.cat([torch.zeros(5, 48), x], dim=1))
    torch.testing.assert_close(to_out._local(x, None), expected)


def _build_worker(rank, world, init_file, result_dir):
    from h3gen.pipelines.h3.tiny_checkpoint import build_tiny_checkpoint

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        build_tiny_checkpoint(os.path.join(result_dir, f"tiny{rank}"))
    finally:
        dist.destroy_process_group()


def test_tiny_checkpoint_builds_whole_on_every_rank(tmp_path):
    # transformers writes model files on rank 0 only; a rank building its own folder must still get all of them.
    mp.spawn(_build_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    names = [sorted(p.name for p in (tmp_path / f"tiny{rank}" / "text_encoder").iterdir()) for rank in range(2)]
    assert names[0] == names[1] and "config.json" in names[1] and any(n.endswith(".safetensors") for n in names[1])
