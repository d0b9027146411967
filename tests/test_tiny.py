"""The tiny demo checkpoint builder and the text encoder's layer truncation."""

import hashlib

import torch

from h3gen.pipelines.h3 import tiny_checkpoint as tiny
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.text_encoder import H3TextEncoder


def _digests(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "modular_model_index.json"
    }


def test_same_seed_same_bytes_and_every_component(tmp_path):
    first = _digests(tiny.build_tiny_checkpoint(tmp_path / "a", seed=3))
    second = _digests(tiny.build_tiny_checkpoint(tmp_path / "b", seed=3))
    other = _digests(tiny.build_tiny_checkpoint(tmp_path / "c", seed=4))
    assert first == second
    assert (
        first["transformer/diffusion_pytorch_model.safetensors"]
        != other["transformer/diffusion_pytorch_model.safetensors"]
    )
    checkpoint = H3Checkpoint.open(tmp_path / "a")
    assert set(tiny.COMPONENTS) <= set(checkpoint.components)
    checkpoint.require("fl2va")


def test_cache_is_reused(tmp_path):
    folder = tiny.tiny_checkpoint(cache_dir=tmp_path)
    stamp = (folder / "transformer" / "config.json").stat().st_mtime_ns
    assert tiny.tiny_checkpoint(cache_dir=tmp_path) == folder
    assert (folder / "transformer" / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left


def test_text_encoder_skips_layers_after_51_with_identical_conditioning(tmp_path, monkeypatch):
    tokenizer = tiny.build_tokenizer()
    monkeypatch.setattr(tiny, "TEXT_LAYERS", 54)
    torch.manual_seed(0)
    full = tiny.build_text_encoder(tokenizer)
    full.save_pretrained(tmp_path / "te")
    tokenizer.save_pretrained(tmp_path / "tok")
    ids = torch.tensor([tokenizer("a quiet street at night", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = full.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=torch.zeros_like(ids),
            use_cache=False,
            output_hidden_states=True,
        ).hidden_states[50]
    encoder = H3TextEncoder.from_pretrained(tmp_path / "te", tmp_path / "tok", None, dtype=torch.float32, device="cpu")
    assert len(encoder.model.model.language_model.layers) == 51
    got = encoder.encode("a quiet street at night")
    assert torch.equal(got.embeds, expected)
    assert got.token_tags.tolist() == [1] * ids.shape[1]
