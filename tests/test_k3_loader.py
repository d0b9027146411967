"""K3 loader layouts beyond the one the tiny checkpoint writes."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3gen.errors import CheckpointError
from h3gen.pipelines.k3.demo_model import build_tiny_checkpoint
from h3gen.pipelines.k3.model import K3ForCausalLM


def _fuse_gate_up(folder, out, mangle=None):
    """Copy the checkpoint, with every dense `gate_proj` / `up_proj` pair stored as one `gate_up_proj` [gate; up]."""
    tensors = load_file(str(folder / "model.safetensors"))
    fused = 0
    for key in [k for k in tensors if k.endswith(".gate_proj.weight")]:
        stem = key[: -len("gate_proj.weight")]
        value = torch.cat([tensors.pop(key), tensors.pop(stem + "up_proj.weight")])
        tensors[stem + "gate_up_proj.weight"] = mangle(value) if mangle else value
        fused += 1
    out.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    save_file(tensors, str(out / "model.safetensors"))
    return fused


def test_fused_dense_gate_up_proj_loads_as_gate_and_up(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "split", seed=1)
    fused = _fuse_gate_up(folder, tmp_path / "fused")
    assert fused == 1 + 4  # layer 0's dense MLP and the four MoE layers' shared experts
    split = K3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    joined = K3ForCausalLM.from_pretrained(tmp_path / "fused", torch_dtype=torch.float32)
    for a, b in zip(split.state_dict().values(), joined.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ids = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(split(ids), joined(ids))


def test_fused_gate_up_proj_with_an_odd_row_count_is_rejected(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "split", seed=1)
    _fuse_gate_up(folder, tmp_path / "bad", mangle=lambda value: value[1:])
    with pytest.raises(CheckpointError, match="gate_up_proj.weight has shape"):
        K3ForCausalLM.from_pretrained(tmp_path / "bad", torch_dtype=torch.float32)
