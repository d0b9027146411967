"""Helpers shared by the H3 tests: tiny configs, random weights, random packed inputs, error metrics."""

import torch

from h3gen.pipelines.h3.packing import build_layout, patchify_video, row_timesteps
from h3gen.pipelines.h3.transformer_config import KEEP_FP32_MODULES

# Tiny transformer configs with different heads, layers and head dims (rope rotates 6 * rope_freq_dim channels).
TINY_CONFIGS = [
    dict(
        num_attention_heads=2,
        attention_head_dim=32,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=2,
        ffn_dim=128,
        text_dim=64,
        freq_dim=32,
        time_embed_hidden_dim=64,
        time_embed_dim=32,
        rope_freq_dim=4,
    ),
    dict(
        num_attention_heads=3,
        attention_head_dim=16,
        hidden_size=40,
        num_layers=1,
        num_refiner_layers=1,
        ffn_dim=72,
        text_dim=24,
        freq_dim=18,
        time_embed_hidden_dim=36,
        time_embed_dim=20,
        rope_freq_dim=2,
    ),
    dict(
        num_attention_heads=4,
        attention_head_dim=24,
        hidden_size=56,
        num_layers=3,
        num_refiner_layers=2,
        ffn_dim=100,
        text_dim=40,
        freq_dim=16,
        time_embed_hidden_dim=48,
        time_embed_dim=24,
        rope_freq_dim=4,
        in_channels=8,
        audio_in_channels=12,
    ),
]


def randomize_(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Give every parameter fresh N(0, scale) values (norm weights around 1), so no layer is an identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator) * scale
            if "norm" in name.split(".")[-2] and name.endswith("weight"):
                noise = 1.0 + noise
            param.copy_(noise.to(param.dtype))


def cast_with_islands_(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast parameters to `dtype` except the float32 islands, as loading a mixed checkpoint does."""
    for name, param in model.named_parameters():
        keep = any(part in KEEP_FP32_MODULES for part in name.split("."))
        param.data = param.data.to(torch.float32 if keep else dtype)
    return model


def random_inputs(
    config: dict,
    *,
    seed: int,
    num_text: int,
    latent_frames: int,
    latent_hw: tuple[int, int],
    audio_latents: int,
    anchors: tuple[str, ...] = (),
    vision_rows: int = 0,
    batch: int = 1,
    distinct_timesteps: int = 2,
) -> dict:
    """Forward kwargs for a random packed request. `vision_rows` text rows are tagged video (a keyframe's vision
    block); `distinct_timesteps` is 1 (audio at the video t, no conditions), 2 or 3 (conditioning rows)."""
    generator = torch.Generator().manual_seed(seed)
    patch = tuple(config.get("patch_size", (1, 2, 2)))
    in_channels = config.get("in_channels", 24)
    audio_channels = config.get("audio_in_channels", 32)
    tags = torch.ones(num_text, dtype=torch.long)
    tags[1 : 1 + vision_rows] = 0
    layout = build_layout(tags, latent_frames, *latent_hw, audio_latents, patch_size=patch, keyframe_anchors=anchors)
    video_t = 0.37
    audio_t = {1: video_t, 2: 0.61, 3: 0.61}[distinct_timesteps]
    timestep, timestep_indices = row_timesteps(layout, video_t, audio_t, 0.999 if anchors else video_t)
    latents = torch.randn(batch, in_channels, latent_frames + len(anchors), *latent_hw, generator=generator)
    video_rows = patchify_video(latents, patch).reshape(batch, -1, in_channels * patch[0] * patch[1] * patch[2])
    return dict(
        hidden_states=video_rows,
        audio_hidden_states=torch.randn(batch, layout.audio_indices.numel(), audio_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, num_text, config["text_dim"], generator=generator),
        timestep=timestep,
        timestep_indices=timestep_indices,
        token_tags=layout.token_tags,
        position_ids=layout.position_ids,
        video_indices=layout.video_indices,
        audio_indices=layout.audio_indices,
        text_indices=layout.text_indices,
    )


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
