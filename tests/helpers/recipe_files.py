"""Tiny few-step adapter files for the tiny checkpoint: a LightX2V Turbo file (PEFT dump of every block's attention
and FFN, named as LightX2V names them) and a FlashGen file (native names, its metadata)."""

import torch

from h3gen.pipelines.h3.transformer_config import H3TransformerConfig
from helpers.lora_files import (
    TURBO_MODULES,
    diffusers_shapes,
    native_shapes,
    random_factors,
    write_diffusers,
    write_native,
)

TURBO_8_768P = "minimax_h3_fl2v_turbo_8step_v1.0_768p_bf16.safetensors"
FLASHGEN = "minimax_h3_t2va_flashgen_4step_v1.0_768p_bf16.safetensors"
FLASHGEN_METADATA = {
    "key_format": "minimax-h3-native",
    "qkv_layout": "grouped",
    "lora_rank": "4",
    "lora_alpha": "4",
    "tasks": "t2va",
    "base_schedule": "1.0,0.7,0.4,0.15,0.0",
}


def write_turbo(folder, checkpoint, name: str = TURBO_8_768P, seed: int = 1):
    """A rank-4 Turbo-shaped adapter for `checkpoint`'s transformer, at `folder / name`."""
    from h3gen.pipelines.h3.transformer import H3Transformer

    model = H3Transformer.from_pretrained(checkpoint / "transformer", torch_dtype=torch.float32)
    shapes = {k: v for k, v in diffusers_shapes(model).items() if k.endswith(TURBO_MODULES)}
    path = folder / name
    write_diffusers(path, random_factors(shapes, 4, seed, scale=0.05), peft=True)
    return path


def write_flashgen(folder, checkpoint, name: str = FLASHGEN, seed: int = 2):
    """A rank-4 FlashGen-shaped native adapter with FlashGen's metadata, at `folder / name`."""
    import json

    config = H3TransformerConfig.from_dict(json.loads((checkpoint / "transformer" / "config.json").read_text()))
    path = folder / name
    write_native(path, random_factors(native_shapes(config), 4, seed, scale=0.05), metadata=FLASHGEN_METADATA)
    return path
