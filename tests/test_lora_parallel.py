"""LoRA under tensor parallel and Ulysses (gloo, 2 processes): a rank applies its shard of each adapter (A whole and
B's rows on column-parallel layers, A's columns and B whole on row-parallel ones, before the collective) and the
ranks together give the single-process output, dense and MXFP4."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.h3_tiny import TINY_CONFIGS, max_rel_err, random_inputs, randomize_
from helpers.lora_files import diffusers_shapes, random_factors, write_diffusers

from h3gen.pipelines.h3.lora_registry import LoraRegistry, activate, check_targets
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer

# Spawns gloo processes: outside the fast tier.
pytestmark = pytest.mark.slow

CONFIG = dict(TINY_CONFIGS[2])  # 4 heads: TP2 and SP2
CASES = [(2, 1), (1, 2)]
INPUTS = dict(num_text=7, latent_frames=3, latent_hw=(4, 4), audio_latents=7, anchors=("first",), distinct_timesteps=3)


def _outputs(model, inputs, lora_path, tiers=("exact", "lossless", "fast")):
    """{tier: (video, audio)} with two stacked adapters from one file (scales 0.7 and -0.3 under two names); the
    fast tier, last, quantizes the model's block linears in place."""
    registry = LoraRegistry(4, head_dim=model.config.attention_head_dim, check=lambda lora: check_targets(model, lora))
    adapters = [
        (registry.adapter(registry.register(lora_path, name)), scale) for name, scale in (("a", 0.7), ("b", -0.3))
    ]
    activate(model, adapters, "t2va", "cpu")
    out = {}
    for tier in tiers:
        set_quality(model, tier)
        activate(model, adapters, "t2va", "cpu")  # FP8 layers that replaced dense ones get the adapters again
        extra = dict(adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0) if tier != "exact" else {}
        with torch.no_grad():
            out[tier] = model(**inputs, return_dict=False, **extra)
    return out


def _worker(rank, world, init_file, payload_path, result_dir):
    from helpers.parallel_model import join_gloo, load_full_state_dict, parallel_transformer

    from h3gen.parallel import init_parallel
    from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

    join_gloo(rank, world, init_file)
    payload = torch.load(payload_path)
    results = []
    try:
        for tp, sp in CASES:
            state = init_parallel(tp, sp, CONFIG["num_attention_heads"])
            model = parallel_transformer(H3TransformerConfig(**CONFIG), state).eval()
            load_full_state_dict(model, payload["state_dict"])
            dense = _outputs(model, payload["inputs"], payload["lora"])
            quantized = H3Transformer.from_pretrained(
                payload["folder"], torch_dtype=torch.float32, parallel=state, quantization="mxfp4"
            ).eval()
            mxfp4 = _outputs(quantized, payload["inputs"], payload["lora"], ("exact",))["exact"]
            results.append({"tp": tp, "sp": sp, "dense": dense, "mxfp4": mxfp4})
    finally:
        torch.save(results, os.path.join(result_dir, f"{rank}.pt"))
        dist.destroy_process_group()


def test_tp_and_ulysses_apply_adapters_as_one_process(tmp_path):
    model = H3Transformer.from_config(CONFIG).eval()
    randomize_(model, seed=4)
    model.save_pretrained(tmp_path / "model")
    lora = tmp_path / "lora.safetensors"
    write_diffusers(lora, random_factors(diffusers_shapes(model), 4, 3, scale=0.4))
    inputs = random_inputs(CONFIG, seed=2, **INPUTS)
    payload = tmp_path / "payload.pt"
    torch.save(
        {"state_dict": model.state_dict(), "inputs": inputs, "lora": str(lora), "folder": str(tmp_path / "model")},
        payload,
    )
    quantized = H3Transformer.from_pretrained(
        tmp_path / "model", torch_dtype=torch.float32, quantization="mxfp4"
    ).eval()
    want_mxfp4 = _outputs(quantized, inputs, str(lora), ("exact",))["exact"]
    with torch.no_grad():
        plain = model(**inputs, return_dict=False)
    want = _outputs(copy.deepcopy(model), inputs, str(lora))
    assert max_rel_err(want["exact"][0], plain[0]) > 0.05  # the adapters change the output
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(payload), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for result in torch.load(tmp_path / f"{rank}.pt"):
            case = (result["tp"], result["sp"])
            for tier in ("exact", "lossless"):
                for got, expected in zip(result["dense"][tier], want[tier], strict=True):
                    assert max_rel_err(got, expected) <= 1e-5, (case, tier)
            # FP8 under TP quantizes each rank's shard (row-parallel inputs get per-shard row scales): as close to
            # the one-process fast output as FP8 rounding allows; Ulysses alone gives the same numbers.
            for got, expected, exact, base in zip(
                result["dense"]["fast"], want["fast"], want["exact"], plain, strict=True
            ):
                fp8_error = max_rel_err(expected, exact)
                assert fp8_error < 0.3 * max_rel_err(exact, base)  # far below the adapters' effect
                if case[0] == 1:
                    assert max_rel_err(got, expected) <= 1e-5, (case, "fast")
                else:
                    assert max_rel_err(got, exact) <= 1.3 * fp8_error, (case, "fast")
            for got, expected in zip(result["mxfp4"], want_mxfp4, strict=True):
                assert max_rel_err(got, expected) <= 1e-4, (case, "mxfp4")
