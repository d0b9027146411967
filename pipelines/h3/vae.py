"""MiniMax-H3's video and audio VAEs (diffusers' classes) and the reference's recipes around them.

Video latents are normalised per channel, `(z - mean) / std`; pixels are ImageNet-normalised RGB over [0, 1].
The audio VAE is mono and float32 only: the two stereo channels are two batch items.
"""

from pathlib import Path

import numpy as np
import torch

from h3gen.errors import CheckpointError
from h3gen.pipelines.h3 import video_decode

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
KEYFRAME_ENCODE_SEED = 42  # the conditioning posterior is sampled under its own fixed seed


def load_video_vae(folder: Path, *, dtype: torch.dtype, device):
    """`AutoencoderKLMiniMaxH3` in `dtype` (its encoder and norms stay float32, as the class pins them)."""
    from diffusers import AutoencoderKLMiniMaxH3  # heavy (seconds to import): imported where it is used

    return (
        AutoencoderKLMiniMaxH3.from_pretrained(str(folder), torch_dtype=dtype).to(device).eval().requires_grad_(False)
    )


def load_audio_vae(folder: Path, *, device):
    """`AutoencoderKLMiniMaxH3Audio`, always float32 (bf16 decodes are ~20 dB quieter)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio  # heavy (seconds to import): imported where it is used

    vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(str(folder), torch_dtype=torch.float32)
    if vae.config.latents_mean is None or vae.config.latents_std is None:
        raise CheckpointError(f"{folder}/config.json must give latents_mean and latents_std (32 floats each).")
    return vae.to(device).eval().requires_grad_(False)


def channel_stat(values, device, ndim: int) -> torch.Tensor:
    """Per-channel `values` (a VAE's latents mean / std, or pixel mean / std) as a float32 tensor shaped to broadcast
    over `(B, C, ...)` of `ndim` dimensions."""
    return torch.tensor(values, device=device).view(1, -1, *([1] * (ndim - 2)))


@torch.no_grad()
def encode_keyframe(vae, image) -> torch.Tensor:
    """One RGB PIL keyframe (already on the canvas) -> normalised latents `(1, C, 1, h, w)` float32 on the CPU.

    The reference recipe: ImageNet-normalise, encode spatially (one frame), *sample* the posterior under seed 42,
    round to float16, normalise per channel.
    """
    return encode_frames(vae, np.array(image)[None])


@torch.no_grad()
def encode_frames(vae, frames: np.ndarray) -> torch.Tensor:
    """`(F, H, W, 3)` uint8 frames -> normalised latents `(1, C, F', h, w)` float32 on the CPU, by the keyframe
    recipe. One frame goes through the spatial encoder alone; more are chunked by 17 (an image or video reference,
    or a keyframe)."""
    device = next(vae.parameters()).device
    pixels = torch.from_numpy(np.ascontiguousarray(frames)).to(device).permute(3, 0, 1, 2)[None]
    pixels = (pixels.to(torch.float32).div(255.0) - channel_stat(PIXEL_MEAN, device, 5)) / channel_stat(
        PIXEL_STD, device, 5
    )
    posterior = vae.encode(pixels, return_dict=False)[0]
    latents = posterior.sample(generator=torch.Generator().manual_seed(KEYFRAME_ENCODE_SEED))
    latents = latents.to(torch.float16).float().cpu()
    mean, std = channel_stat(vae.config.latents_mean, "cpu", 5), channel_stat(vae.config.latents_std, "cpu", 5)
    return (latents - mean) / std


@torch.no_grad()
def encode_sound(vae, waveform: torch.Tensor) -> torch.Tensor:
    """A `(2, N)` float32 waveform at 32 kHz -> normalised audio rows `(2 * A, C)` float32 on the CPU, channel-major
    (the two channels are two batch items of the mono VAE). Sound takes the posterior *mean*, never a sample."""
    device = next(vae.parameters()).device
    posterior = vae.encode(waveform.to(device, torch.float32)[:, None], return_dict=False)[0]
    latents = posterior.mode().float().cpu().transpose(1, 2)  # (2, A, C)
    mean = torch.tensor(vae.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(vae.config.latents_std).view(1, 1, -1)
    return ((latents - mean) / std).reshape(-1, latents.shape[-1])


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, *, tier: str = "exact", check=None, on_device: bool = False):
    """Normalised latents `(1, C, F, h, w)` float32 -> frames `(frames, H, W, 3)` float32 in [0, 1]: numpy on the
    host, or (`on_device`) a tensor where the VAE ran. `tier` picks the decoder run (`video_decode.decode`: "exact"
    is diffusers' own); `check()` runs before each decoder block (progress and cancellation)."""
    device = latents.device
    z = latents * channel_stat(vae.config.latents_std, device, 5) + channel_stat(vae.config.latents_mean, device, 5)
    video = video_decode.decode(vae, z, tier=tier, check=check)
    video = (video.float() * channel_stat(PIXEL_STD, device, 5) + channel_stat(PIXEL_MEAN, device, 5)).clamp(0, 1)
    frames = video[0].permute(1, 2, 3, 0)
    return frames if on_device else frames.cpu().numpy()


@torch.no_grad()
def decode_audio(vae, latents: torch.Tensor) -> np.ndarray:
    """Normalised latents `(2, C, A)` float32 (two channels as batch) -> waveform `(2, A * 800)` float32 in [-1, 1]."""
    device = latents.device
    z = latents * channel_stat(vae.config.latents_std, device, 3) + channel_stat(vae.config.latents_mean, device, 3)
    audio = vae.decode(z, return_dict=False)[0]
    return audio.float()[:, 0].cpu().numpy()


# The units of work each VAE call is made of, in the order they run: the pipeline reports progress (a cancellation
# point) before each, so a long encode or decode stops within one unit. They name diffusers' submodules.


def video_encoder_units(vae) -> list[torch.nn.Module]:
    """The video encoder's down blocks (run once per clip and spatial tile)."""
    return list(vae.encoder.down_blocks)


def video_decoder_units(vae) -> list[torch.nn.Module]:
    """The video ViT decoder's transformer blocks (run once per clip and spatial tile)."""
    return list(vae.decoder.transformer_blocks)


def audio_encoder_units(vae) -> list[torch.nn.Module]:
    """The audio encoder's stages (one waveform pass)."""
    return list(vae.encoder.block)


def audio_decoder_units(vae) -> list[torch.nn.Module]:
    """The BigVGAN decoder's upsamplers and its anti-aliased activations, where its time goes (one pass: 7 + 127
    units in the released model, whose whole decode takes about 3 s)."""
    decoder = vae.decoder
    activations = [activation for block in decoder.resblocks for activation in block.activations]
    return [up[0] for up in decoder.ups] + activations + [decoder.activation_post]
