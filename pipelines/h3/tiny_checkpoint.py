"""A tiny random-weight MiniMax-H3 checkpoint in the real on-disk (diffusers) layout.

Every component of the released repository is there, shrunk: both transformer partitions (`transformer/` for t2va
and fl2va, `transformer_ref/` for ref2va), both VAEs (released compression geometry, thin widths), a Qwen3-VL text
encoder with 51 thin decoder layers (so `hidden_states[50]` exists), a byte-level tokenizer built locally with
`tokenizers`, the image and video processor configs and both schedulers. Weights are
random, so generated pictures and sound are noise; the point is that every code path runs, fast, on a CPU.

The checkpoint is fully determined by its seed and is cached after the first build (`tiny_checkpoint()`).
"""

import json
from pathlib import Path

import torch

from h3gen.loading.cached_build import cached_folder, default_cache_dir
from h3gen.pipelines.h3.schedules import write_scheduler_config
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

# Bump when the builder changes what it writes, so stale caches are rebuilt.
TINY_FORMAT = 3  # 3: the three-stage audio VAE; 2: transformer_ref/, the video processor config

TRANSFORMER = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=128,
    in_channels=24,
    audio_in_channels=32,
    patch_size=[1, 2, 2],
    text_dim=64,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=4,
)
VIDEO_VAE = dict(
    block_out_channels=[8] * 6,
    layers_per_block=1,
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
    decoder_num_register_tokens=4,
    decoder_ffn_mult=2,
)
# The released hop (800 samples per latent) in three stages instead of five and seven, one resblock kernel per stage:
# the released layout's stages and kernels made its decoder cost several times the tiny model's whole denoise.
AUDIO_VAE = dict(
    encoder_dim=4,
    encoder_rates=(8, 10, 10),
    latent_dim=64,
    num_attention_heads=2,
    decoder_dim=32,
    decoder_rates=(8, 10, 10),
    decoder_kernel_sizes=(16, 20, 20),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
)
TEXT_HIDDEN, TEXT_LAYERS = 64, 51
# Qwen3-VL's text model and vision tower, thin (the vocabulary is the tokenizer's).
TEXT_CONFIG = dict(
    hidden_size=TEXT_HIDDEN,
    intermediate_size=128,
    num_hidden_layers=TEXT_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
VISION_CONFIG = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=TEXT_HIDDEN,
    num_position_embeddings=256,
    deepstack_visual_indexes=[0, 1],
)
TINY_CANVAS_SHORT_EDGE, TINY_CANVAS_MAX_PIXELS = 64, 64 * 112
TINY_REFERENCE_IMAGE_SHORT_EDGE = 96  # the released checkpoint encodes image references at 2048
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The index diffusers' ModularPipeline reads: which library and class each component folder holds.
COMPONENTS = {
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
}


def build_tokenizer():
    """A byte-level BPE with no merges (one token per byte) plus Qwen's special tokens: 263 tokens, offline."""
    from transformers import Qwen2TokenizerFast  # heavy (seconds to import): imported where it is used
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<|endoftext|>": 0}
    for index, symbol in enumerate(bytes_to_unicode().values()):
        vocab[symbol] = index + 1
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tokenizer


def build_text_encoder(tokenizer):
    """Qwen3-VL with a 64-wide, 51-layer text model and a 2-block vision tower (random weights)."""
    # transformers is heavy (seconds to import): imported where it is used
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(TEXT_CONFIG, vocab_size=len(tokenizer)),
        vision_config=VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def build_image_processor():
    """Qwen3-VL's image processing (patch 16, merge 2), PIL backend so no torchvision is needed."""
    # transformers is heavy (seconds to import): imported where it is used
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 64 * 64, "longest_edge": 1024 * 1024},
    )


def video_processor_config() -> dict:
    """Qwen3-VL's video processing for the tiny encoder (patch 16, merge 2, pairs of frames), as
    `video_preprocessor_config.json` holds it."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "rescale_factor": 1 / 255,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "size": {"shortest_edge": 64 * 64, "longest_edge": 1024 * 1024},
    }


def _write_index(folder: Path) -> None:
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": "0.42.1",
        "_blocks_class_name": "MiniMaxH3Blocks",
        # A small canvas (64 px short edge) keeps demo runs fast; released checkpoints say 768 and 768 * 1344.
        "canvas_short_edge": TINY_CANVAS_SHORT_EDGE,
        "canvas_max_pixels": TINY_CANVAS_MAX_PIXELS,
        "reference_image_short_edge": TINY_REFERENCE_IMAGE_SHORT_EDGE,
    }
    for name, (library, class_name) in COMPONENTS.items():
        spec = dict(
            pretrained_model_name_or_path=str(folder),
            subfolder=name,
            type_hint=[library, class_name],
            revision=None,
            variant=None,
        )
        index[name] = [library, class_name, spec]
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2))


def build_tiny_checkpoint(folder, seed: int = 0, transformer: dict | None = None) -> Path:
    """Write the tiny checkpoint into `folder` (created). Same seed, same bytes (for one torch version).
    `transformer` overrides entries of the transformer config (both partitions; `text_dim` must stay 64)."""
    # diffusers is heavy (seconds to import): imported where it is used
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = H3TransformerConfig(**{**TRANSFORMER, **(transformer or {})})
        H3Transformer(config).save_pretrained(folder / "transformer")

        generator = torch.Generator().manual_seed(seed + 1)
        mean = (torch.randn(24, generator=generator) * 0.1).tolist()
        std = (0.5 + torch.rand(24, generator=generator)).tolist()
        AutoencoderKLMiniMaxH3(**VIDEO_VAE, latents_mean=mean, latents_std=std).save_pretrained(folder / "vae")
        mean = (torch.randn(32, generator=generator) * 0.1).tolist()
        std = (0.5 + torch.rand(32, generator=generator)).tolist()
        AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE, latents_mean=mean, latents_std=std).save_pretrained(
            folder / "audio_vae"
        )

        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(folder / "tokenizer")
        text_encoder = build_text_encoder(tokenizer)
        # transformers writes model files only on rank 0 of an initialised process group; this folder is private
        # to the process building it, so every rank writes its own.
        text_encoder.should_save_on_this_rank = lambda is_main_process: True
        text_encoder.save_pretrained(folder / "text_encoder")

        # ref2va's own partition: the same architecture, other weights (built last, so the rest keeps its bytes).
        torch.manual_seed(seed + 2)
        H3Transformer(config).save_pretrained(folder / "transformer_ref")
    tokenizer.save_pretrained(folder / "processor")
    build_image_processor().save_pretrained(folder / "processor")
    (folder / "processor" / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(), indent=2))
    write_scheduler_config(folder / "scheduler", shift=12.0)
    write_scheduler_config(folder / "audio_scheduler", shift=3.0)
    _write_index(folder)
    (folder / "README.md").write_text(
        f"Tiny random-weight MiniMax-H3 checkpoint (seed {seed}) built by h3gen for tests and demos.\n"
        "Its pictures and sound are noise.\n"
    )
    return folder


def tiny_checkpoint(seed: int = 0, cache_dir=None) -> Path:
    """The cached tiny checkpoint for `seed`, built on first use (atomically, so a crash leaves no half folder)."""
    import diffusers  # heavy (seconds to import): only the cache tag needs their versions
    import transformers

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    versions = f"t{torch.__version__.split('+')[0]}-d{diffusers.__version__}-tf{transformers.__version__}"
    tag = f"tiny-h3-f{TINY_FORMAT}-s{seed}-{versions}"
    target = cache_dir / tag

    def build(staging: Path, final: Path) -> None:
        build_tiny_checkpoint(staging, seed)
        _write_index_location(staging, final)  # the index records its own folder: point it at the final one

    return cached_folder(target, "modular_model_index.json", build)


def _write_index_location(folder: Path, location: Path) -> None:
    index_path = folder / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    for name in COMPONENTS:
        index[name][2]["pretrained_model_name_or_path"] = str(location)
    index_path.write_text(json.dumps(index, indent=2))


def build_tiny_student(
    base: Path,
    folder: Path,
    *,
    gates: bool = True,
    seed: int = 0,
    contract: dict | None = None,
    gate_scale=0.05,
    weights: dict | None = None,
) -> Path:
    """A FastH3-style student of the tiny checkpoint at `base`, written into `folder`: the same components, its
    `transformer/` given one random attention gate per block (`to_gate_compress`, normal * `gate_scale`) when `gates`,
    and a root `fastvideo_inference.json` holding `contract` (the fields FastVideo writes; None: no contract file).
    `weights` (key -> tensor) replace or add transformer tensors (e.g. the base weights with an adapter's deltas
    applied, and its gates: then no random gates are drawn)."""
    import shutil

    from safetensors.torch import load_file

    folder = Path(folder)
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("transformer", "transformer_ref"))
    state = {}
    for path in sorted((Path(base) / "transformer").glob("*.safetensors")):
        state.update(load_file(str(path)))
    state.update(weights or {})
    config = H3TransformerConfig.from_dict(json.loads((Path(base) / "transformer" / "config.json").read_text()))
    model = H3Transformer(config, gates=gates)
    if gates and not any(key.endswith(".attn.to_gate_compress.weight") for key in state):
        generator = torch.Generator().manual_seed(seed)
        inner = config.num_attention_heads * config.attention_head_dim
        for index in range(config.num_layers):
            gate = torch.randn(inner, config.hidden_size, generator=generator) * gate_scale
            state[f"transformer_blocks.{index}.attn.to_gate_compress.weight"] = gate
    model.load_state_dict(state, strict=True)
    model.save_pretrained(folder / "transformer")
    shutil.copytree(Path(base) / "transformer_ref", folder / "transformer_ref")
    _write_index_location(folder, folder)
    if contract is not None:
        (folder / "fastvideo_inference.json").write_text(json.dumps(contract, indent=2))
    return folder


# What a FastH3 adapter changes in every block (LoRA factors), and the tensors the tiny one gives full deltas.
FASTH3_BLOCK_LORA = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
FASTH3_TINY_DIFFS = ("proj_in", "time_embedder.linear_1", "norm_out.linear", "norm_out.norm")
FASTH3_TINY_DIFF_BIASES = ("proj_out", "audio_proj_in", "norm_out.linear")


def build_tiny_fasth3_adapter(
    base: Path,
    path: Path,
    *,
    gates: bool = True,
    rank: int = 8,
    seed: int = 0,
    prefix: str = "",
    dtype: torch.dtype = torch.float32,
    finetuned_model: str | None = None,
) -> Path:
    """A `fastvideo-lora-v2` file for the tiny checkpoint at `base`, written to `path`: rank-`rank` `lora_A` /
    `lora_B` on every documented block target (transformer blocks with `adaln_proj.linear`, refiner blocks without),
    `.diff` on each block's `norm1` and the `FASTH3_TINY_DIFFS` weights, `.diff_b` on every `adaln_proj.linear.bias`
    and the `FASTH3_TINY_DIFF_BIASES`, and with `gates` a `.set_weight` VSA gate per block; keys under `prefix`
    (e.g. "transformer."). Random normal values, fully determined by `seed`."""
    from safetensors.torch import save_file

    config = H3TransformerConfig.from_dict(json.loads((Path(base) / "transformer" / "config.json").read_text()))
    with torch.device("meta"):
        shapes = {key: tuple(t.shape) for key, t in H3Transformer(config, gates=True).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    tensors = {}
    modules = [
        f"transformer_blocks.{i}.{m}"
        for i in range(config.num_layers)
        for m in (*FASTH3_BLOCK_LORA, "adaln_proj.linear")
    ]
    modules += [
        f"token_refiner.refiner_blocks.{i}.{m}" for i in range(config.num_refiner_layers) for m in FASTH3_BLOCK_LORA
    ]
    for module in modules:
        out, inner = shapes[f"{module}.weight"]
        tensors[f"{module}.lora_A.weight"] = draw(rank, inner, scale=0.1)
        tensors[f"{module}.lora_B.weight"] = draw(out, rank, scale=0.05)
    for module in (*FASTH3_TINY_DIFFS, *(f"transformer_blocks.{i}.norm1" for i in range(config.num_layers))):
        tensors[f"{module}.diff"] = draw(*shapes[f"{module}.weight"], scale=0.02)
    biases = (
        *FASTH3_TINY_DIFF_BIASES,
        *(f"transformer_blocks.{i}.adaln_proj.linear" for i in range(config.num_layers)),
    )
    for module in biases:
        tensors[f"{module}.diff_b"] = draw(*shapes[f"{module}.bias"], scale=0.02)
    if gates:
        for i in range(config.num_layers):
            gate = f"transformer_blocks.{i}.attn.to_gate_compress"
            tensors[f"{gate}.set_weight"] = draw(*shapes[f"{gate}.weight"], scale=0.05)
    kind = "VSA" if gates else "Dense"
    metadata = {
        "format": "fastvideo-lora-v2",
        "base_model": "MiniMaxAI/MiniMax-H3",
        "finetuned_model": finetuned_model or f"FastVideo/FastVideo-FastH3-4-step-Tiny-{kind}",
        "rank": str(rank),
        "low_rank_tensors": str(sum(key.endswith(".weight") for key in tensors)),
        "diff_tensors": str(sum(key.endswith((".diff", ".diff_b")) for key in tensors)),
        "set_weight_tensors": str(sum(key.endswith(".set_weight") for key in tensors)),
        "application": "W = W_base + lora_B @ lora_A; then .diff / .diff_b added; then .set_weight assigned",
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + key: value.contiguous() for key, value in tensors.items()}, str(path), metadata=metadata)
    return path
