"""Loading H3 transformer checkpoints: diffusers' sharded save_pretrained output and the original release layout."""

import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from helpers.h3_tiny import TINY_CONFIGS, max_rel_err, random_inputs, randomize_
from safetensors.torch import save_file

from h3gen.errors import CheckpointError
from h3gen.pipelines.h3.layouts import to_original_layout
from h3gen.pipelines.h3.transformer import H3Transformer

CONFIG = TINY_CONFIGS[2]
INPUTS = dict(num_text=6, latent_frames=3, latent_hw=(4, 2), audio_latents=7, anchors=("last",))


@pytest.fixture(scope="module")
def reference():
    model = MiniMaxH3Transformer3DModel(**CONFIG).eval()
    randomize_(model, seed=7)
    return model


def _outputs(model, seed=3):
    with torch.no_grad():
        return model(**random_inputs(CONFIG, seed=seed, **INPUTS), return_dict=False)


def _write_original(folder, state_dict, qkv_layout, shards=2):
    """Write `state_dict` in the original release's key layout, sharded with an index like the MiniMaxAI repo."""
    folder.mkdir(parents=True, exist_ok=True)
    original = to_original_layout(state_dict, CONFIG["num_attention_heads"], CONFIG["attention_head_dim"], qkv_layout)
    keys = sorted(original)
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: original[k] for k in keys[index::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return original


def test_sharded_diffusers_checkpoint_reproduces_diffusers(reference, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").exists()
    ours = H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.float32)
    for got, expected in zip(_outputs(ours), _outputs(reference), strict=True):
        assert max_rel_err(got, expected) <= 1e-6


def test_bf16_load_keeps_fp32_islands_and_matches_diffusers(reference, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    ours = H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    theirs = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    for name, param in ours.named_parameters():
        assert param.dtype == dict(theirs.named_parameters())[name].dtype, name
    assert ours.proj_in.weight.dtype == torch.float32 and ours.time_embedder.linear_1.weight.dtype == torch.float32
    assert ours.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16
    for got, expected in zip(_outputs(ours), _outputs(theirs), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_original_layout_loads_and_reproduces(reference, tmp_path, qkv_layout):
    original = _write_original(tmp_path, reference.state_dict(), qkv_layout)
    assert any(".attn.qkv_proj.weight" in k for k in original) and any(".mlp.fc1." in k for k in original)
    ours = H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.float32, qkv_layout=qkv_layout)
    for got, expected in zip(_outputs(ours), _outputs(reference), strict=True):
        assert max_rel_err(got, expected) <= 1e-6


@pytest.mark.parametrize("qkv_layout", ["interleaved", "stacked"])
def test_original_layout_writer_agrees_with_diffusers_converter(reference, qkv_layout):
    state = reference.state_dict()
    original = to_original_layout(state, CONFIG["num_attention_heads"], CONFIG["attention_head_dim"], qkv_layout)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(original), CONFIG, qkv_layout=qkv_layout)
    assert sorted(converted) == sorted(state)
    for key, tensor in state.items():
        assert torch.equal(converted[key], tensor), key


def test_wrong_qkv_layout_changes_the_result(reference, tmp_path):
    _write_original(tmp_path, reference.state_dict(), "interleaved")
    ours = H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.float32, qkv_layout="stacked")
    assert max_rel_err(_outputs(ours)[0], _outputs(reference)[0]) > 1e-3


def test_missing_unexpected_and_mismatched_keys_are_named(reference, tmp_path):
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del state["transformer_blocks.1.attn.to_k.weight"]
    state["transformer_blocks.0.extra.weight"] = torch.zeros(3)
    state["norm_out.linear.bias"] = torch.zeros(5)
    tmp_path.mkdir(exist_ok=True)
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError) as info:
        H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.float32)
    message = str(info.value)
    assert "missing keys: transformer_blocks.1.attn.to_k.weight" in message
    assert "unexpected keys: transformer_blocks.0.extra.weight" in message
    assert "norm_out.linear.bias: checkpoint (5,), model (112,)" in message


def test_missing_folder_files_and_bad_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        H3Transformer.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match="No safetensors weights"):
        H3Transformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        H3Transformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(CheckpointError, match="not a MiniMax-H3 transformer"):
        H3Transformer.from_pretrained(tmp_path)


def test_index_pointing_at_missing_shard(reference, tmp_path):
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        H3Transformer.from_pretrained(tmp_path)


def test_load_builds_on_meta_and_never_holds_a_float32_copy(reference, tmp_path, monkeypatch):
    # Every tensor is cast straight from the file to its target dtype: no float32 tensor of a bf16 layer is created.
    reference.to(torch.bfloat16).save_pretrained(tmp_path)
    reference.float()
    created, calls = [], []
    original_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = original_to(self, *args, **kwargs)
        calls.append(out.dtype)
        if out.dtype == torch.float32 and out.numel() >= 4096 and out.device.type != "meta":
            created.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    ours = H3Transformer.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    monkeypatch.undo()
    assert torch.bfloat16 in calls  # the spy saw the loader's casts
    assert created == []  # islands here are all < 4096 elements; block weights stayed bf16 throughout
    assert ours.transformer_blocks[0].ff.net[0].proj.weight.dtype == torch.bfloat16
