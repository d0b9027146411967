"""A complete `H3Pipeline` with random weights and no checkpoint on disk: what a full-size request costs (time,
GPU memory, host memory) can be measured before the released weights are at hand.

`random_pipeline()` writes a config-only checkpoint folder (the component configs, a byte-level tokenizer, the
processor configs, both schedulers; no weight file) and builds every component from it with random weights, each
one tensor at a time where it will live: the transformer through the real loader (`load_transformer` with a
generated tensor source, so MXFP4 weights are quantized as they are made and tensor-parallel ranks keep their
shards), the text encoder and the VAEs on the device or on the host as the run's offload mode places them.

Sizes: "released" (the 33 B transformer, Qwen3-VL-32B's text model and vision tower at their released widths, the
released VAEs and canvas) or "tiny" (the test checkpoint's dims, for CPU tests). Random values are drawn on the GPU
when there is one (a CPU draws 50 GB far more slowly) and copied to where they live.
"""

import json
import math
import tempfile
from pathlib import Path

import torch

from h3gen.loading.load import keeps_fp32, meta_parameters
from h3gen.options import RunOptions
from h3gen.pipelines.h3 import tiny_checkpoint as tiny
from h3gen.pipelines.h3.assembly import PartBuilders, assemble
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.pipeline import H3Pipeline
from h3gen.pipelines.h3.schedules import write_scheduler_config
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

SIZES = ("released", "tiny")
# Qwen3-VL-32B, the text encoder MiniMax-H3 was released with: 64 layers of width 5120 (only the first 51 are built,
# as `H3TextEncoder` loads them), 64 query / 8 key-value heads of 128, interleaved M-RoPE (24, 20, 20).
RELEASED_TEXT = dict(
    vocab_size=151936,
    hidden_size=5120,
    intermediate_size=25600,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rope_parameters=dict(
        rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20], mrope_interleaved=True
    ),
)
RELEASED_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=5120,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
RELEASED_CANVAS = (768, 768 * 1344)  # short edge, most pixels


def _draw_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def random_value(name: str, shape, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """A random tensor for parameter `name`: matrices and kernels N(0, 1/fan_in), biases 0, layer scales (the ViT
    decoder's `scale1` / `scale2`, zero in the class's init) 0.1 + N(0, 0.02), other vectors (norm weights, Snake
    alphas) 1 + N(0, 0.05), so activations keep their scale through deep random stacks. Drawn on the generator's
    device, returned on `device`."""
    shape = tuple(shape)
    draw = generator.device
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) >= 2:
        fan_in = max(1, math.prod(shape[1:]))
        value = torch.empty(shape, dtype=dtype, device=draw).normal_(0.0, fan_in**-0.5, generator=generator)
    elif leaf == "bias":
        value = torch.zeros(shape, dtype=dtype, device=draw)
    elif leaf in ("scale1", "scale2"):
        value = torch.empty(shape, dtype=dtype, device=draw).normal_(0.1, 0.02, generator=generator)
    else:
        value = torch.empty(shape, dtype=dtype, device=draw).normal_(1.0, 0.05, generator=generator)
    return value.to(device)


def random_tensors(config: H3TransformerConfig, *, dtype: torch.dtype, seed: int = 0, gates: bool = False):
    """`(key, tensor)` for every weight of an H3 transformer in the diffusers layout, one at a time (float32
    islands in float32): the tensor source `load_transformer` takes in place of weight files. `gates`: a VSA
    student's, with every block's `to_gate_compress`."""
    with meta_parameters():
        dense = H3Transformer(config, gates=gates)
    generator = torch.Generator(_draw_device()).manual_seed(seed)
    for key, slot in dense.state_dict().items():
        wanted = torch.float32 if keeps_fp32(key, H3Transformer.keep_fp32_modules) else dtype
        if not slot.is_floating_point():
            continue
        yield key, random_value(key, slot.shape, wanted, generator.device, generator)


def materialize(module: torch.nn.Module, *, device, dtype: torch.dtype, keep_fp32=(), seed: int = 0) -> None:
    """Give every parameter of a module built on the meta device a random value in place, on `device`, in `dtype`
    (float32 for names matching `keep_fp32`); buffers (computed in `__init__`) move to `device`."""
    generator = torch.Generator(_draw_device()).manual_seed(seed)
    for name, param in list(module.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        wanted = torch.float32 if keeps_fp32(name, keep_fp32) else dtype
        owner._parameters[leaf] = torch.nn.Parameter(
            random_value(name, param.shape, wanted, device, generator), requires_grad=False
        )
    for name, buffer in list(module.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[leaf] = buffer.to(device)


def _configs(sizes: str) -> dict:
    if sizes == "tiny":
        text = dict(tiny.TEXT_CONFIG, vocab_size=263)  # the byte-level tokenizer's 257 symbols and 6 special tokens
        vision = tiny.VISION_CONFIG
        return dict(
            transformer=tiny.TRANSFORMER,
            vae=tiny.VIDEO_VAE,
            audio_vae=tiny.AUDIO_VAE,
            text=text,
            vision=vision,
            canvas=(tiny.TINY_CANVAS_SHORT_EDGE, tiny.TINY_CANVAS_MAX_PIXELS),
        )
    return dict(
        transformer={}, vae={}, audio_vae={}, text=RELEASED_TEXT, vision=RELEASED_VISION, canvas=RELEASED_CANVAS
    )


def write_config_folder(folder, sizes: str = "released", seed: int = 0) -> Path:
    """A checkpoint folder in diffusers' layout holding every config and no weight: what `random_pipeline`
    builds from."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio  # heavy: imported where used
    from transformers import Qwen3VLConfig

    if sizes not in SIZES:
        raise ValueError(f"sizes must be one of {', '.join(SIZES)} (got {sizes!r}).")
    configs = _configs(sizes)
    folder = Path(folder)
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    config = H3TransformerConfig(**configs["transformer"]).to_dict()
    (folder / "transformer" / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed + 1)
    vae_stats = dict(
        latents_mean=(torch.randn(24, generator=generator) * 0.1).tolist(),
        latents_std=(0.5 + torch.rand(24, generator=generator)).tolist(),
    )
    audio_stats = dict(
        latents_mean=(torch.randn(32, generator=generator) * 0.1).tolist(),
        latents_std=(0.5 + torch.rand(32, generator=generator)).tolist(),
    )
    with meta_parameters():
        AutoencoderKLMiniMaxH3(**configs["vae"], **vae_stats).save_config(folder / "vae")
        AutoencoderKLMiniMaxH3Audio(**configs["audio_vae"], **audio_stats).save_config(folder / "audio_vae")
    tokenizer = tiny.build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")
    tokenizer.save_pretrained(folder / "processor")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in tiny.SPECIAL_TOKENS}
    Qwen3VLConfig(
        text_config=configs["text"],
        vision_config=configs["vision"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    ).save_pretrained(folder / "text_encoder")
    tiny.build_image_processor().save_pretrained(folder / "processor")
    (folder / "processor" / "video_preprocessor_config.json").write_text(
        json.dumps(tiny.video_processor_config(), indent=2)
    )
    write_scheduler_config(folder / "scheduler", shift=12.0)
    write_scheduler_config(folder / "audio_scheduler", shift=3.0)
    short_edge, max_pixels = configs["canvas"]
    index = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": "0.42.1",
        "canvas_short_edge": short_edge,
        "canvas_max_pixels": max_pixels,
    }
    (folder / "modular_model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def _text_encoder(folder: Path, *, dtype, device, seed: int):
    """Qwen3-VL from `folder/text_encoder/config.json`, cut to the layers H3 runs, random weights on `device`."""
    from accelerate import init_empty_weights  # heavy: imported where used
    from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration

    from h3gen.pipelines.h3.text_encoder import TEXT_ENCODER_LAYER, H3TextEncoder, load_image_processor
    from h3gen.pipelines.h3.video_processor import QwenVideoProcessor

    config = AutoConfig.from_pretrained(str(folder / "text_encoder"))
    config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER + 1
    if getattr(config.text_config, "layer_types", None):
        config.text_config.layer_types = config.text_config.layer_types[: TEXT_ENCODER_LAYER + 1]
    with init_empty_weights():
        model = Qwen3VLForConditionalGeneration(config)
    materialize(model, device=device, dtype=dtype, seed=seed)
    model = model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    return H3TextEncoder(
        model,
        tokenizer,
        load_image_processor(folder / "processor"),
        video_processor=QwenVideoProcessor.from_folder(folder / "processor"),
    )


def _vaes(folder: Path, *, dtype, device, seed: int):
    from accelerate import init_empty_weights  # heavy: imported where used
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    with init_empty_weights():
        vae = AutoencoderKLMiniMaxH3.from_config(AutoencoderKLMiniMaxH3.load_config(str(folder / "vae")))
        audio_vae = AutoencoderKLMiniMaxH3Audio.from_config(
            AutoencoderKLMiniMaxH3Audio.load_config(str(folder / "audio_vae"))
        )
    materialize(vae, device=device, dtype=dtype, keep_fp32=vae._keep_in_fp32_modules, seed=seed)
    materialize(audio_vae, device=device, dtype=torch.float32, seed=seed + 1)
    return vae.eval().requires_grad_(False), audio_vae.eval().requires_grad_(False)


def random_pipeline(
    device=None,
    *,
    sizes: str = "released",
    seed: int = 0,
    torch_dtype: torch.dtype = torch.bfloat16,
    folder=None,
    options: RunOptions | None = None,
    student: bool = False,
    **option_keywords,
):
    """An `H3Pipeline` (t2va and fl2va) with random weights at `sizes` ("released" or "tiny"), built without any
    weight file.

    The run options are `H3Pipeline.from_pretrained`'s (`options` and/or its keywords: quality, offload,
    gpu_memory, prefetch, quantization, attention) and place the parts the same way: with offload "none" every
    part is made on the device; with "stage" the text encoder and the VAEs are made on the host; with "layerwise"
    the transformer's blocks are made (and quantized, with `quantization="mxfp4"`) on the device one tensor at a
    time, then moved to pinned host memory to stream within `gpu_memory`, and the text encoder streams its layers.
    `folder` keeps the config-only checkpoint (default: a temporary folder). The same seed gives the same weights.
    `student=True` builds a FastH3 VSA student (attention gates in every block), which runs the published contract.
    """
    options = RunOptions.merged(options, **option_keywords)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = write_config_folder(folder or tempfile.mkdtemp(prefix="h3gen-random-"), sizes, seed)
    config = H3TransformerConfig.from_dict(json.loads((folder / "transformer" / "config.json").read_text()))

    def transformer(name, placement, store):
        # Quantizing on the host would take minutes at full size: blocks are made on the device even when they
        # stream.
        build_device = device if options.quantization else placement.transformer_device
        model = H3Transformer.from_pretrained(
            folder / name,
            torch_dtype=torch_dtype,
            device=build_device,
            quantization=options.quantization,
            tensors=random_tensors(config, dtype=torch_dtype, seed=seed, gates=student),
            gates=student,
        )
        if build_device != placement.transformer_device:
            model = model.to(placement.transformer_device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return model

    builders = PartBuilders(
        transformer,
        lambda placement: _text_encoder(folder, dtype=torch_dtype, device=placement.stage_device, seed=seed + 10),
        lambda placement: _vaes(folder, dtype=torch_dtype, device=placement.stage_device, seed=seed + 20),
    )
    return assemble(H3Pipeline, H3Checkpoint.open(folder), options, device, builders)
