"""The K3 text model: Kimi-Linear parity with transformers, state handoff between prefill and decode, LatentMoE /
SiTU / AttnRes against float64 code written from the equations, MXFP4 experts against their dequantized weights,
and greedy generation from the tiny K3 checkpoint."""

import dataclasses
import json

import pytest
import torch
from helpers.k3_reference import kimi_linear_torch, max_rel_error

from h3gen.errors import CheckpointError
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.demo_model import build_tiny_checkpoint, randomize, tiny_config
from h3gen.pipelines.k3.model import K3ForCausalLM, K3MoE

KIMI_LINEAR_CONFIGS = [
    # MLA with one q_proj, grouped routing, MLA in the middle
    dict(
        hidden_size=40,
        num_hidden_layers=4,
        num_attention_heads=3,
        q_lora_rank=None,
        kv_lora_rank=12,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=14,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        moe_intermediate_size=20,
        intermediate_size=36,
        linear_attn_config=dict(
            head_dim=8, num_heads=3, short_conv_kernel_size=4, kda_layers=[1, 3, 4], full_attn_layers=[2]
        ),
        first_k_dense_replace=1,
    ),
    # q LoRA, two MLA layers, ungrouped routing, no dense layer
    dict(
        hidden_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        q_lora_rank=20,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=24,
        intermediate_size=64,
        linear_attn_config=dict(
            head_dim=16, num_heads=2, short_conv_kernel_size=3, kda_layers=[1, 3], full_attn_layers=[2, 4]
        ),
        first_k_dense_replace=0,
    ),
]


def _save_kimi_linear(folder, fields, seed):
    """A tiny random KimiLinearForCausalLM written by save_pretrained, with non-trivial norms and router biases."""
    from transformers import KimiLinearConfig

    modeling = kimi_linear_torch()
    config = KimiLinearConfig(vocab_size=83, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)
    torch.manual_seed(seed)
    model = modeling.KimiLinearForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or name.endswith("e_score_correction_bias"):
                tensor.add_(torch.randn(tensor.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return modeling.KimiLinearForCausalLM


@pytest.mark.parametrize("index", range(len(KIMI_LINEAR_CONFIGS)))
def test_kimi_linear_checkpoint_matches_transformers_fp32(tmp_path, index):
    reference_cls = _save_kimi_linear(tmp_path, KIMI_LINEAR_CONFIGS[index], seed=index)
    reference = reference_cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = K3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert ours.config.attention_types == [
        "kda" if t == "linear_attention" else "mla" for t in reference.config.layer_types
    ]
    ids = torch.randint(0, 83, (2, 70), generator=torch.Generator().manual_seed(index))  # crosses a 64-chunk
    with torch.no_grad():
        expected = reference(ids).logits
        actual = ours(ids)
    assert max_rel_error(actual, expected) <= 1e-4


def _kimi_linear_style_model(seed=0):
    config = K3Config(
        model_type="kimi_linear",
        vocab_size=71,
        hidden_size=40,
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        attention_types=["kda", "mla", "kda", "mla"],
        ffn_types=["dense", "moe", "moe", "moe"],
        num_attention_heads=3,
        q_lora_rank=None,
        kv_lora_rank=12,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=14,
        linear_num_heads=3,
        linear_head_dim=8,
        intermediate_size=36,
        moe_intermediate_size=20,
        num_experts=6,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_scaling_factor=2.446,
    )
    return randomize(K3ForCausalLM(config), seed).eval()


def _tiny_k3_model(seed=0, **overrides):
    config = K3Config.from_dict(tiny_config())
    config = dataclasses.replace(config, experts_mxfp4=False, **overrides)
    return randomize(K3ForCausalLM(config), seed).eval()


@pytest.mark.parametrize("family", ["kimi_linear", "k3"])
@pytest.mark.parametrize("prompt,chunk,decode", [(37, 0, 5), (64, 9, 3)])
def test_prefill_then_decode_matches_full_prefill(family, prompt, chunk, decode):
    # State handoff: KDA recurrent + conv state, paged MLA latent cache; a prefill chunk continuing from a cache.
    model = _kimi_linear_style_model() if family == "kimi_linear" else _tiny_k3_model()
    ids = torch.randint(
        0, model.config.vocab_size, (2, prompt + chunk + decode), generator=torch.Generator().manual_seed(prompt)
    )
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(page_size=8)
        parts = [model(ids[:, :prompt], cache)]
        if chunk:
            parts.append(model(ids[:, prompt : prompt + chunk], cache))
        for i in range(prompt + chunk, ids.shape[1]):
            parts.append(model(ids[:, i : i + 1], cache))
    assert cache.seen_tokens == ids.shape[1]
    assert max_rel_error(torch.cat(parts, dim=1), full) <= 1e-4


def _rms64(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _situ64(gate, up, beta, linear_beta):
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)


def test_latent_moe_with_situ_matches_float64_equations():
    model = _tiny_k3_model(seed=3)
    c = model.config
    moe = model.model.layers[1].mlp
    assert isinstance(moe, K3MoE)
    x = torch.randn(23, c.hidden_size, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad():
        actual = moe(x)
    W = {name: p.detach().double() for name, p in moe.named_parameters()}
    bias = moe.gate.e_score_correction_bias.double()
    x64 = x.double()
    scores = torch.sigmoid(x64 @ W["gate.weight"].t())
    expected = torch.zeros_like(x64)
    for t in range(x64.shape[0]):
        chosen = torch.argsort(scores[t] + bias, descending=True)[: c.num_experts_per_token]
        weights = scores[t, chosen] / scores[t, chosen].sum() * c.routed_scaling_factor
        h = W["routed_expert_down_proj.weight"] @ x64[t]
        y = torch.zeros(c.routed_expert_hidden_size, dtype=torch.float64)
        for w, e in zip(weights, chosen.tolist(), strict=True):
            act = _situ64(
                W[f"experts.{e}.w1.weight"] @ h, W[f"experts.{e}.w3.weight"] @ h, c.situ_beta, c.situ_linear_beta
            )
            y = y + w * (W[f"experts.{e}.w2.weight"] @ act)
        y = _rms64(y, W["routed_expert_norm.weight"], c.rms_norm_eps)
        shared = W["shared_experts.down_proj.weight"] @ _situ64(
            W["shared_experts.gate_proj.weight"] @ x64[t],
            W["shared_experts.up_proj.weight"] @ x64[t],
            c.situ_beta,
            c.situ_linear_beta,
        )
        expected[t] = W["routed_expert_up_proj.weight"] @ y + shared
    assert max_rel_error(actual, expected) < 1e-5


def test_situ_caps_gate_and_up():
    from h3gen.pipelines.k3.layers import situ_and_mul

    gate = torch.tensor([-100.0, -1.0, 0.0, 0.5, 3.0, 100.0])
    up = torch.tensor([1000.0, -2.0, 5.0, 1.0, -1000.0, 1.0])
    out = situ_and_mul(gate, up, 4.0, 25.0)
    expected = _situ64(gate.double(), up.double(), 4.0, 25.0)
    assert max_rel_error(out, expected) < 1e-6
    assert out[-1].item() == pytest.approx(4.0 * 25.0 * torch.tanh(torch.tensor(1 / 25)).item(), rel=1e-5)
    assert out[0].abs().item() < 1e-20  # a very negative gate switches the unit off


@pytest.mark.parametrize("block", [1, 2, 3])
def test_attn_res_blocks_match_float64_equations(block):
    model = _tiny_k3_model(seed=4, attn_res_block_size=block)
    c = model.config
    embeds = torch.randn(2, 9, c.hidden_size, generator=torch.Generator().manual_seed(block))
    with torch.no_grad():
        actual = model.model(embeds)

    def mix(rows, query, norm):  # float64, written from the equations
        stacked = torch.stack(rows)
        keys = stacked / torch.sqrt((stacked * stacked).mean(-1, keepdim=True) + c.rms_norm_eps) * norm.double()
        p = torch.softmax(keys @ query.double().reshape(-1), dim=0)
        return (p[..., None] * stacked).sum(0)

    with torch.no_grad():
        bank, partial = [], embeds.double()
        for number, layer in enumerate(model.model.layers):
            x = mix(bank + [partial], layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight)
            if number % block == 0:
                bank.append(partial)
                partial = torch.zeros_like(x)
            partial = partial + layer.attention(x.float(), None, number).double()
            x = mix(bank + [partial], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight)
            partial = partial + layer.feed_forward(x.float()).double()
        out = mix(bank + [partial], model.model.output_attn_res_proj.weight, model.model.output_attn_res_norm.weight)
        expected = _rms64(out, model.model.norm.weight.double(), c.rms_norm_eps)
    assert len(bank) == -(-c.num_hidden_layers // block)
    # float32 sub-layers in both; the mixing differs in precision only (a bookkeeping slip gives errors of order 1)
    assert max_rel_error(actual, expected) < 5e-5


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-k3"), seed=0)


def test_mxfp4_experts_match_dequantized_bf16(tiny_k3):
    quantized = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.bfloat16)
    assert type(quantized.model.layers[1].mlp.experts[0].w2).__name__ == "MXFP4Linear"
    dense = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.bfloat16)
    swapped = 0
    for expert in (m for m in dense.modules() if type(m).__name__ == "K3Expert"):
        for name in ("w1", "w2", "w3"):  # the same weights, dequantized to a plain bf16 linear
            layer = getattr(expert, name)
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, dtype=torch.bfloat16)
            linear.weight.data = layer.dequantized_weight(torch.bfloat16)
            setattr(expert, name, linear)
            swapped += 1
    assert swapped == 4 * 5 * 3
    ids = torch.randint(0, 524, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = quantized(ids).float(), dense(ids).float()
    assert max_rel_error(a, b) < 2e-2  # bf16 rounding of two op orders; the weights are identical
    moe_q, moe_d = quantized.model.layers[2].mlp, dense.model.layers[2].mlp
    h = torch.randn(11, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w, ids = moe_q.gate(torch.randn(11, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(moe_q.routed(h, w, ids), moe_d.routed(h, w, ids))


def test_tiny_k3_checkpoint_loads_and_generates_greedy(tiny_k3):
    config = json.loads((tiny_k3 / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    model = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.float32)
    prompt = torch.randint(3, 268, (1, 12), generator=torch.Generator().manual_seed(7))
    new = model.generate(prompt, max_new_tokens=8)
    assert new.shape == (1, 8)
    sequence = torch.cat([prompt, new], dim=1)
    with torch.no_grad():
        logits = model(sequence)  # one full forward: every generated token must be its argmax
    assert torch.equal(logits[0, prompt.shape[1] - 1 : -1].argmax(-1), new[0])


def test_loader_reports_missing_and_unknown_tensors(tiny_k3, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_k3 / "model.safetensors"))
    tensors.pop("language_model.model.layers.2.self_attn.g_proj.weight")
    tensors["language_model.model.layers.0.self_attn.bogus"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_k3 / "config.json").read_text())
    with pytest.raises(CheckpointError, match="g_proj.*bogus|missing keys.*g_proj"):
        K3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)


def test_config_layer_lists_are_one_indexed_and_checked():
    config = tiny_config()
    parsed = K3Config.from_dict(config)
    assert parsed.attention_types == ["kda", "kda", "mla", "kda", "kda"]
    assert parsed.ffn_types == ["dense", "moe", "moe", "moe", "moe"] and parsed.experts_mxfp4
    config["text_config"]["linear_attn_config"]["full_attn_layers"] = [3, 5]
    with pytest.raises(CheckpointError, match="kda_layers"):
        K3Config.from_dict(config)
    with pytest.raises(CheckpointError, match="model_type"):
        K3Config.from_dict({"model_type": "llama"})
