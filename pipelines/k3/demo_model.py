"""A tiny random-weight K3 checkpoint in the real on-disk layout, for tests and the demo.

`config.json` is the K3 outer config (`model_type="kimi_k3"`, `text_config`, `vision_config`, a compressed-tensors
MXFP4 `quantization_config`); the weights use the release's keys (`language_model.model.layers.{i}.
block_sparse_moe.experts.{e}.w1.weight_packed` / `weight_scale` for the MXFP4 routed experts, bf16 elsewhere,
float32 for `A_log`, `dt_bias`, the short convs and the router bias; `A_log` 1-D of length head_dim). Every K3 part
is there, shrunk: KDA with the full-rank gate and the safe gate, gated MLA with a q LoRA, a dense first layer,
LatentMoE with SiTU experts and shared experts, block Attention Residuals, and a MoonViT-3d vision tower with its
projector (`vision_tower.*`, `mm_projector.*`, bf16; `preprocessor_config.json` holds the `media_proc_cfg`, small
limits so test images stay a few patches). Weights are random, so text is noise.
"""

import base64
import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3gen.loading.cached_build import cached_folder, default_cache_dir
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.model import K3ForCausalLM
from h3gen.quant.mxfp4_format import quantize

# Bump when the builder changes what it writes, so stale caches are rebuilt.
TINY_FORMAT = 2

# Tokenizer: the 256 bytes, a few merges, then the 256 special ids (named ones first).
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b"an", b"ll", b"llo", b"ello"]
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "[EOT]",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "[UNK]",
    "[PAD]",
]
BASE_VOCAB = 256 + len(MERGES)
VOCAB_SIZE = BASE_VOCAB + 256
BOS_ID, EOS_ID, MEDIA_PAD_ID = BASE_VOCAB, BASE_VOCAB + 1, BASE_VOCAB + SPECIAL_TOKENS.index("<|media_pad|>")

TEXT_CONFIG = dict(
    model_type="kimi_linear",
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=5,
    intermediate_size=96,
    rms_norm_eps=1e-5,
    hidden_act="situ",
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
    num_attention_heads=2,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    mla_use_nope=True,
    mla_use_output_gate=True,
    num_experts=5,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    latent_moe_use_norm=True,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    moe_router_activation_func="sigmoid",
    moe_renormalize=True,
    use_grouped_topk=True,
    num_expert_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    routed_scaling_factor=2.5,
    attn_res_block_size=2,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=BASE_VOCAB + 12,
    linear_attn_config=dict(
        num_heads=2,
        head_dim=16,
        short_conv_kernel_size=4,
        use_full_rank_gate=True,
        gate_lower_bound=-5.0,
        kda_layers=[1, 2, 4, 5],
        full_attn_layers=[3],
    ),
)
QUANTIZATION_CONFIG = dict(
    quant_method="compressed-tensors",
    format="mxfp4-pack-quantized",
    config_groups={
        "group_0": dict(
            format="mxfp4-pack-quantized", targets=["Linear"], weights=dict(num_bits=4, type="float", group_size=32)
        )
    },
    ignore=["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*routed_expert_.*", "re:.*gate$", "lm_head"],
)

# Odd sizes on purpose: a 6x5 position table (so every image interpolates it), head dim 16, 2 blocks.
VISION_CONFIG = dict(
    patch_size=14,
    init_pos_emb_height=6,
    init_pos_emb_width=5,
    init_pos_emb_time=4,
    pos_emb_type="divided_fixed",
    pos_emb_interpolation_mode="bilinear",
    vt_num_attention_heads=2,
    vt_num_hidden_layers=2,
    vt_hidden_size=24,
    vt_intermediate_size=40,
    qkv_hidden_size=32,
    norm_type="rmsnorm",
    attn_bias=False,
    linear_bias=False,
    patch_embed_proj_bias=False,
    activation_func="gelu_pytorch_tanh",
    merge_kernel_size=[2, 2],
    merge_type="sd2_tpool",
    mm_projector_type="patchmergerv2",
    mm_hidden_size=24,
    projector_hidden_act="gelu",
    projector_ln_eps=1e-5,
    text_hidden_size=TEXT_CONFIG["hidden_size"],
)
MEDIA_PROC_CFG = dict(
    patch_size=14,
    merge_kernel_size=2,
    in_patch_limit=48,
    patch_limit_on_one_side=10,
    image_mean=[0.48, 0.46, 0.41],
    image_std=[0.27, 0.26, 0.28],
    transparent_bg_config=dict(pattern="white"),
)


def tiny_config() -> dict:
    """The tiny checkpoint's `config.json` as a dict (K3 outer layout); a fresh deep copy on every call."""
    text = copy.deepcopy(dict(TEXT_CONFIG, quantization_config=QUANTIZATION_CONFIG))
    config = dict(
        model_type="kimi_k3",
        architectures=["KimiK3ForConditionalGeneration"],
        text_config=text,
        pad_token_id=0,
        ignore_index=-100,
        media_placeholder_token_id=MEDIA_PAD_ID,
        vision_config=copy.deepcopy(VISION_CONFIG),
    )
    return config


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill a K3 model with random weights of sensible scale (in place), deterministic in `seed`: linears
    ~ N(0, 1/in), norms 1 + N(0, 0.1), decay rates A = exp(A_log) in [1, 16], small conv taps, non-zero AttnRes
    queries and router biases (so softmaxes and selections are not uniform)."""
    device = next(model.parameters()).device  # drawn where the model lives (a GPU fills a large model fast)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = name.rpartition(".")[0].rpartition(".")[2]  # the module holding the parameter
            shape = param.shape

            def randn(*size):
                return torch.randn(*size, generator=generator, device=device)

            if name.endswith("A_log"):
                value = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=generator).log()
            elif name.endswith("dt_bias"):
                value = randn(*shape) * 0.5
            elif "conv1d" in name:
                value = randn(*shape) * 0.5
            elif "norm" in owner:
                value = 1.0 + 0.1 * randn(*shape)
            elif name.endswith("res_proj.weight"):
                value = randn(*shape) * 0.5
            elif param.ndim == 2:
                value = randn(*shape) / math.sqrt(shape[1])
            elif param.ndim == 4:  # the vision patch embedding (a conv over one patch)
                value = randn(*shape) / math.sqrt(math.prod(shape[1:]))
            else:
                value = randn(*shape) * 0.1
            param.copy_(value.to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(randn_like(buffer, generator) * 0.05)
    return model


def randn_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tensor.shape, generator=generator, device=generator.device).to(tensor.device, tensor.dtype)


def checkpoint_tensors(model, config) -> dict[str, torch.Tensor]:
    """The model's state dict under the release's keys, routed experts quantized to MXFP4."""
    fp32 = ("A_log", "dt_bias", "conv1d", "e_score_correction_bias")
    out = {}
    for key, tensor in model.state_dict().items():
        if key.startswith(("vision_tower.", "mm_projector.")):  # the tower's keys are the checkpoint's
            key_out = key
        else:
            key_out = "language_model." + key.replace(".mlp.", ".block_sparse_moe.")
        tensor = tensor.detach()
        if key.endswith("self_attn.A_log"):  # stored 1-D with head_dim entries, the first num_heads used
            padded = torch.zeros(config.linear_head_dim)
            padded[: tensor.numel()] = tensor
            tensor = padded
        if ".experts." in key and key.endswith(".weight"):
            packed, scales = quantize(tensor.float())
            out[key_out[: -len("weight")] + "weight_packed"] = packed
            out[key_out[: -len("weight")] + "weight_scale"] = scales
            continue
        if any(part in key for part in fp32):
            out[key_out] = tensor.float().contiguous()
        else:
            out[key_out] = tensor.to(torch.bfloat16).contiguous()
    return out


def write_tokenizer(folder: Path) -> None:
    """`tiktoken.model` (base64 token, rank) and `tokenizer_config.json` naming the special ids."""
    tokens = [bytes([b]) for b in range(256)] + MERGES
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    )
    added = {
        str(BASE_VOCAB + i): dict(
            content=name, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True
        )
        for i, name in enumerate(SPECIAL_TOKENS)
    }
    config = dict(
        tokenizer_class="TikTokenTokenizer",
        added_tokens_decoder=added,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        model_max_length=1048576,
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_tiny_checkpoint(folder, seed: int = 0) -> Path:
    """Write the tiny K3 checkpoint into `folder` (created). Same seed, same bytes (for one torch version)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_config()
    config = K3Config.from_dict(config_dict)
    dense = K3Config.from_dict(config_dict)
    dense.experts_mxfp4 = False
    model = randomize(K3ForCausalLM(dense), seed)
    save_file(checkpoint_tensors(model, config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2))
    write_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(dict(media_proc_cfg=MEDIA_PROC_CFG), indent=2))
    (folder / "README.md").write_text(
        f"Tiny random-weight K3 checkpoint (seed {seed}) built by h3gen for tests and demos. Its text is noise.\n"
    )
    return folder


def tiny_checkpoint(seed: int = 0, cache_dir=None) -> Path:
    """The cached tiny K3 checkpoint for `seed`, built on first use (atomically: a crash leaves no half folder)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"tiny-k3-f{TINY_FORMAT}-s{seed}-t{torch.__version__.split('+')[0]}"
    return cached_folder(target, "config.json", lambda staging, _: build_tiny_checkpoint(staging, seed))
