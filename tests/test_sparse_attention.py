"""Sparse attention in the pipeline: the per-forward sparsity a request resolves to, the tile geometry of a packed
sequence, the base model at sparsity 0 equal to dense attention, a FastH3 VSA student (tiny, gates non-zero) end to
end with its contract, what a student refuses, and a student whose gates are all zero equal to the base model."""

import json

import numpy as np
import pytest
import torch

from h3gen.errors import CheckpointError, RequestError
from h3gen.pipelines.h3 import GenerationRequest, H3Pipeline, resolve_sparsity
from h3gen.pipelines.h3.fasth3 import read_student_contract
from h3gen.pipelines.h3.packing import build_layout
from h3gen.pipelines.h3.sparse_attention import packed_geometry
from h3gen.pipelines.h3.tiny_checkpoint import build_tiny_student

CONTRACT = {
    "schema_version": "fasth3-inference-contract-v1",
    "model_id": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-VSA-DataFree",
    "task": "t2av",
    "transformer_forwards": 4,
    "num_inference_steps": 5,
    "dmd_denoising_steps": [999, 749, 500, 250],
    "guidance_scale": 1.0,
    "attention_backend": "VIDEO_SPARSE_ATTN_H3",
    "vsa_tile_size": 64,
    "vsa_sparsity": 0.9,
}


def test_a_request_resolves_to_one_sparsity_per_forward():
    assert resolve_sparsity(None, None, 4) is None
    assert resolve_sparsity(None, None, 4, contract=0.9) == (0.9,) * 4
    assert resolve_sparsity(0.5, 1, 3) == (0.0, 0.5, 0.5)
    assert resolve_sparsity([0.1, 0.2, 0.3], None, 3) == (0.1, 0.2, 0.3)
    assert resolve_sparsity("default", None, 49) == (0.0,) * 10 + (0.75,) * 39
    assert resolve_sparsity("default", 2, 4) == (0.0, 0.0, 0.75, 0.75)
    assert resolve_sparsity(0.0, None, 2) == (0.0, 0.0)
    assert resolve_sparsity(None, 0, 3) is None  # a form's empty "first forwards dense" field
    for sparsity, dense, field, words in (
        (1.0, None, "sparsity", "in [0, 1)"),
        (-0.1, None, "sparsity", "in [0, 1)"),
        (float("nan"), None, "sparsity", "in [0, 1)"),
        (True, None, "sparsity", "in [0, 1)"),
        ([0.5, 0.5], None, "sparsity", "this request runs 3, the list has 2"),
        ("most", None, "sparsity", '"default"'),
        (0.5, 4, "dense_forwards", "from 0 to the request's 3 forwards"),
        (None, 1, "dense_forwards", "needs sparsity"),
    ):
        with pytest.raises(RequestError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as e:
            resolve_sparsity(sparsity, dense, 3)
        assert e.value.field == field


@pytest.mark.parametrize("anchors,guide", [((), 0), (("first", "last"), 0), ((), 2)], ids=["t2va", "fl2va", "window"])
def test_the_tile_geometry_follows_the_packed_segments(anchors, guide):
    layout = build_layout(70, 9, 6, 10, 23, keyframe_anchors=anchors, guide_frames=guide, guide_audio_latents=3 * guide)
    grid = (9, 3, 5)
    tiles = packed_geometry(layout, layout.num_condition_video_rows, layout.num_condition_audio_rows, grid)
    conditions = layout.num_condition_video_rows + layout.num_condition_audio_rows
    assert tiles.num_rows == layout.sequence_length == 70 + conditions + 46 + 135
    assert tiles.prefix_rows == 70 + conditions + 46
    # 70 text rows: 2 chunks; conditions: ceil(n / 64) chunks; 46 audio rows: 1; video (9, 3, 5): 3 x 1 x 2 tiles.
    assert tiles.num_prefix_tiles == 2 + -(-conditions // 64) + 1 and tiles.num_video_tiles == 6
    with pytest.raises(ValueError, match=r"\[text \| conditions \| audio \| video\]"):
        packed_geometry(layout, layout.num_condition_video_rows, layout.num_condition_audio_rows, (9, 3, 4))


def test_the_base_model_at_sparsity_zero_is_dense_attention(tiny_dir):
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    run = dict(seed=3, num_inference_steps=4, num_frames=124)
    dense = pipe("a cat on a piano", **run)
    assert np.array_equal(pipe("a cat on a piano", sparsity=0.0, **run).video, dense.video)
    sparse = pipe("a cat on a piano", sparsity=0.9, **run)
    assert not np.array_equal(sparse.video, dense.video) and sparse.sampling["sparsity"] == [0.9] * 3
    assert np.array_equal(pipe("a cat on a piano", sparsity=0.9, dense_forwards=3, **run).video, dense.video)


@pytest.fixture(scope="module")
def student(tiny_dir, tmp_path_factory):
    return build_tiny_student(tiny_dir, tmp_path_factory.mktemp("fasth3") / "student", contract=CONTRACT)


def test_a_vsa_student_runs_its_contract_and_refuses_others(student):
    pipe = H3Pipeline.from_pretrained(student, device="cpu", torch_dtype=torch.float32)
    assert pipe.student.sparsity == 0.9 and pipe.student.recipe.base_schedule == (0.999, 0.749, 0.5, 0.25, 0.0)
    output = pipe("a cat on a piano", seed=3, num_frames=124)
    sampling = output.sampling
    assert (sampling["forwards"], sampling["recipe"], sampling["sparsity"]) == (4, "FastH3 4-step (VSA)", [0.9] * 4)
    sigmas = pipe.prepare(GenerationRequest("x", num_frames=124)).sampling.schedules()[0].sigmas
    # The DMD positions shifted by 12: 0.999917, 0.972833, 0.923077, 0.8, 0.
    assert torch.allclose(sigmas, torch.tensor([0.999917, 0.972833, 0.923077, 0.8, 0.0]), atol=1e-6)
    denser = pipe("a cat on a piano", seed=3, num_frames=124, sparsity=0.5)
    assert not np.array_equal(denser.video, output.video)
    for fields, field, words in (
        (dict(num_inference_steps=10), "num_inference_steps", "runs 4 transformer forwards"),
        (dict(image=np.zeros((64, 128, 3), np.uint8)), "task", "FastH3 4-step (VSA) recipe serves t2va, not fl2va"),
        (dict(sparsity=[0.9] * 3), "sparsity", "this request runs 4, the list has 3"),
    ):
        with pytest.raises(RequestError, match=words.replace("(", r"\(").replace(")", r"\)")) as error:
            pipe.prepare(GenerationRequest("x", num_frames=124, **fields))
        assert error.value.field == field


def test_a_student_with_zero_gates_at_sparsity_zero_is_the_base_model(tiny_dir, tmp_path):
    """The gated branch adds gate * compressed: zero gates add nothing, so sparsity 0 gives dense attention."""
    zero = build_tiny_student(tiny_dir, tmp_path / "zero", contract=None, gate_scale=0.0)
    student = H3Pipeline.from_pretrained(zero, device="cpu", torch_dtype=torch.float32)
    base = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    inputs = GenerationRequest("a cat", seed=5, num_frames=124, sparsity=0.0)
    got = student.run(inputs)
    # The base model on the student's grid: its recipe's sigma points, as a FlashGen-style explicit schedule.
    prepared = base.prepare(inputs.replace(sparsity=None))
    prepared.sampling = student.prepare(inputs).sampling
    assert np.array_equal(base.run(prepared).video, got.video)


def test_contract_files_that_cannot_run_are_refused(tmp_path):
    def contract(**changes):
        (tmp_path / "fastvideo_inference.json").write_text(json.dumps(CONTRACT | changes))
        return tmp_path

    for changes, gated, words in (
        (dict(schema_version="v2"), True, "not a fasth3-inference-contract-v1 contract"),
        (dict(task="i2av"), True, "t2va only"),
        (dict(dmd_denoising_steps=[999, 500], transformer_forwards=4), True, "one per transformer forward"),
        (dict(vsa_tile_size=256), True, "vsa_tile_size 256"),
        (dict(), False, "no to_gate_compress weights"),
        (dict(attention_backend="FLASH_ATTN"), True, "runs VIDEO_SPARSE_ATTN_H3 only"),
    ):
        with pytest.raises(CheckpointError, match=words):
            read_student_contract(contract(**changes), gated=gated, video_shift=12.0, audio_shift=3.0)
    dense = read_student_contract(contract(attention_backend="FLASH_ATTN"), gated=False, video_shift=12, audio_shift=3)
    assert dense.sparsity is None and dense.recipe.name == "FastH3 4-step (dense)"
    (tmp_path / "fastvideo_inference.json").unlink()
    assert read_student_contract(tmp_path, gated=False, video_shift=12, audio_shift=3) is None
    assert read_student_contract(tmp_path, gated=True, video_shift=12, audio_shift=3).sparsity == 0.9


def test_a_student_missing_some_gates_is_refused_when_it_loads(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_tiny_student(tiny_dir, tmp_path / "partial", contract=CONTRACT)
    [path] = (folder / "transformer").glob("*.safetensors")
    state = load_file(str(path))
    del state["transformer_blocks.1.attn.to_gate_compress.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="to_gate_compress"):
        H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["exact", "lossless", "fast"])
def test_a_streamed_student_equals_the_resident_one(tier):
    """Layer-wise offload streams each block's gate with the block: the output is the resident model's (exact,
    lossless); the fast tier's FP8 GEMMs leave the gate in full precision, fed the dequantized rows."""
    from helpers.h3_tiny import TINY_CONFIGS, random_inputs, randomize_

    from h3gen.kernels.vsa_h3 import SparsePlan, build_tile_geometry
    from h3gen.offload import apply_layerwise_offload
    from h3gen.pipelines.h3.tiers import set_quality
    from h3gen.pipelines.h3.transformer import H3Transformer

    config = dict(TINY_CONFIGS[2], num_layers=4)
    reference = H3Transformer(H3Transformer.from_config(config).config, gates=True).eval()
    randomize_(reference, seed=5)
    model = H3Transformer(reference.config, gates=True).eval()
    model.load_state_dict(reference.state_dict())
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    for one in (reference, model):
        set_quality(one, tier)
    block = sum(
        p.numel() * p.element_size()
        for n, p in model.transformer_blocks[0].named_parameters()
        if not n.startswith("adaln_proj")
    )
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "transformer_blocks." not in n)
    if tier != "fast":
        apply_layerwise_offload(model, "cpu", gpu_memory=other + 2 * block, activation_reserve=0, prefetch=1)
        assert model.offload_plan.streamed
    else:
        assert model.transformer_blocks[0].attn.to_gate_compress.weight.dtype == torch.float32
    # 9 latent frames of 4 x 4 (post-patch 2 x 2): 3 video tiles; 8 keyframe rows and 14 audio rows before them.
    inputs = random_inputs(
        config,
        seed=1,
        num_text=6,
        latent_frames=9,
        latent_hw=(4, 4),
        audio_latents=7,
        anchors=("first",),
        distinct_timesteps=3,
    )
    rows = inputs["position_ids"].shape[0]
    plan = SparsePlan(build_tile_geometry((6, 4, 14), (9, 2, 2), rows), 0.5)
    for one in (reference, model):
        one.sparse.plan = plan
    extra = {}
    if tier != "exact":
        extra = dict(adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False, **extra)
        got = model(**inputs, return_dict=False, **extra)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    if tier == "fast":  # against the same student in full precision: FP8's error, not a missing gate
        exact = H3Transformer(reference.config, gates=True).eval()
        exact.load_state_dict(weights)
        exact.sparse.plan = plan
        with torch.no_grad():
            full = exact(**inputs, return_dict=False)
            for block in exact.transformer_blocks:
                block.attn.to_gate_compress.weight.zero_()
            ungated = exact(**inputs, return_dict=False)
        error = (got[0] - full[0]).norm() / full[0].norm()
        assert error < 0.15 and error < (got[0] - ungated[0]).norm() / ungated[0].norm() / 2


def _parallel_worker(rank, world, init_file, student_dir, base_dir, result_dir):
    import os

    import torch.distributed as dist
    from helpers.parallel_model import join_gloo

    from h3gen.parallel import init_parallel

    join_gloo(rank, world, init_file)
    try:
        clips = []
        for tp, sp in ((1, world), (world, 1)):  # the tiny model has 2 heads: Ulysses 2, then TP 2
            state = init_parallel(tp, sp, 2)
            for name, folder, sparsity in (("student", student_dir, None), ("base", base_dir, 0.6)):
                pipe = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32, parallel=state)
                output = pipe(
                    "a cat",
                    seed=4,
                    num_inference_steps=4 if name == "base" else None,
                    num_frames=124,
                    sparsity=sparsity,
                    decode=rank == 0,
                )
                clips.append({"tp": tp, "sp": sp, "name": name, "video": output.video})
        torch.save(clips, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ulysses_and_tensor_parallel_give_the_single_process_clip(student, tiny_dir, tmp_path):
    """The gate travels with q/k/v through Ulysses' all-to-all and is sharded with its heads under TP: a sparse
    student's and the sparse base model's clips under Ulysses 2 and TP 2 (gloo) are the single process's."""
    import torch.multiprocessing as mp

    single = {
        "student": H3Pipeline.from_pretrained(student, device="cpu", torch_dtype=torch.float32)(
            "a cat", seed=4, num_frames=124
        ),
        "base": H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)(
            "a cat", seed=4, num_inference_steps=4, num_frames=124, sparsity=0.6
        ),
    }
    mp.spawn(
        _parallel_worker,
        args=(2, str(tmp_path / "init"), str(student), str(tiny_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    clips = torch.load(tmp_path / "0.pt", weights_only=False)
    assert [(c["tp"], c["sp"], c["name"]) for c in clips] == [
        (1, 2, "student"),
        (1, 2, "base"),
        (2, 1, "student"),
        (2, 1, "base"),
    ]
    for clip in clips:
        assert np.abs(clip["video"] - single[clip["name"]].video).max() <= 1e-4, (clip["tp"], clip["name"])


@pytest.mark.slow
def test_a_long_clip_tiles_each_window_on_its_own_grid(tiny_dir, tmp_path):
    """A 20 s clip is two windows, each packed with the previous window's tail as conditions: each gets its own tile
    geometry (sparsity 0 is the dense clip exactly; 0.5 changes it), and the step cache runs beside it."""
    from h3gen.media import probe_mp4

    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    run = dict(seconds=20, num_inference_steps=3, seed=2)
    paths = {name: tmp_path / f"{name}.mp4" for name in ("dense", "zero", "sparse")}
    for name, sparsity in (("dense", None), ("zero", 0.0), ("sparse", 0.5)):
        output = pipe("a long cat", sparsity=sparsity, output_path=paths[name], **run)
        assert output.windows == 2
    assert paths["zero"].read_bytes() == paths["dense"].read_bytes()
    assert paths["sparse"].read_bytes() != paths["dense"].read_bytes()
    assert probe_mp4(paths["sparse"]).num_frames == probe_mp4(paths["dense"]).num_frames
    cached = pipe("a cat", num_inference_steps=6, sparsity=0.5, seed=2, quality="high")
    assert cached.sampling["sparsity"] == [0.5] * 5
