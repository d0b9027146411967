"""The video VAE's decode, batched: the same clips, tiles and blends as diffusers' `AutoencoderKLMiniMaxH3.decode`,
with every (clip, tile) piece of a request run through the ViT decoder together.

diffusers 0.42.1 (`models/autoencoders/autoencoder_kl_minimax_h3.py`, `_decode` and `_decode_clip`) decodes a
request clip by clip (7 latent frames each, consecutive clips sharing 2) and, within a clip, tile by tile
(256 x 256 pixels, overlapping by at least 64): a 5 s 768x1344 request is 7 clips x 28 tiles = 196 decoder calls of
1,797 tokens (1,792 latent voxels, 4 register tokens, 1 zero token), each too short to fill the GPU. All pieces
have one shape, so here they go through the decoder in batches as large as memory allows, and are then stitched
and cross-faded with the class's own `_split_tiles`, `_stitch_tiles` and `_blend`.

Tiers: "exact" is diffusers' own `decode`. "lossless" runs the decoder blocks in this module: the same float32
residual stream and float32 norms as the class, each norm one pass that hands bf16 to the GEMMs, q/k norm + RoPE in
one pass (`h3gen.kernels`), bf16 GEMMs, attention through `h3gen.kernels.attention` ("auto": FlashAttention-3 on
Hopper). "fast" is "lossless" with the block GEMMs in FP8 (`to_fp8_decoder`) fed e4m3 rows straight from the norms
and SwiGLU: an approximation.
"""

import math
from typing import Callable

import torch

from h3gen.kernels.attention import attention
from h3gen.kernels.norm_modulate import rmsnorm_modulate
from h3gen.kernels.qk_norm_rope import qk_norm_rope
from h3gen.kernels.rmsnorm import rms_norm
from h3gen.kernels.swiglu import swiglu
from h3gen.linear import to_fp8
from h3gen.quant.fp8 import Fp8Linear

TIERS = ("exact", "lossless", "fast")
# Peak activation bytes per decoder token (float32 residual and norms, bf16 q/k/v, the 4x SwiGLU up-projection and
# its output, attention), measured with some margin: sizes a batch to the memory the device has free.
_BYTES_PER_TOKEN = 128 * 1024
_CPU_BATCH = 8


def to_fp8_decoder(vae) -> None:
    """Put the ViT decoder's block GEMMs (q, k, v, out, SwiGLU up and down) in FP8 in place (the `fast` tier);
    layers already in FP8 stay as they are."""

    def fp8(layer):
        return layer if isinstance(layer, Fp8Linear) else to_fp8(layer)

    for block in vae.decoder.transformer_blocks:
        attn, ff = block.attn, block.ff
        attn.to_q, attn.to_k, attn.to_v = fp8(attn.to_q), fp8(attn.to_k), fp8(attn.to_v)
        attn.to_out[0] = fp8(attn.to_out[0])
        ff.net[0].proj = fp8(ff.net[0].proj)
        ff.net[2] = fp8(ff.net[2])


def _norm(hidden: torch.Tensor, norm, dtype: torch.dtype, fp8: bool):
    """The block's float32 RMSNorm of the float32 residual, handed to the GEMMs in `dtype` (one pass), or as e4m3
    rows (`fp8`; `rmsnorm_modulate` with zero modulation is the plain norm)."""
    if not fp8:
        return rms_norm(hidden, norm.weight, norm.eps, out_dtype=dtype)
    zeros = hidden.new_zeros(1, hidden.shape[-1])
    index = torch.zeros(hidden.shape[1], dtype=torch.long, device=hidden.device)
    return rmsnorm_modulate(hidden, norm.weight, zeros, zeros, index, norm.eps, fp8=True)


def _block(
    block, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, backend: str, fp8: bool
) -> torch.Tensor:
    """`MiniMaxH3VideoTransformerBlock.forward` on the float32 residual `(B, N, D)`, updated in place: the norms in
    float32 (as the class pins them), q/k RMSNorm + partial RoPE in one pass, bf16 (or FP8) GEMMs."""
    attn = block.attn
    normed = _norm(hidden, block.norm1, dtype, fp8)
    query = attn.to_q(normed).unflatten(2, (attn.heads, -1))
    key = attn.to_k(normed).unflatten(2, (attn.heads, -1))
    value = attn.to_v(normed).unflatten(2, (attn.heads, -1))
    ones = torch.ones(query.shape[-1], dtype=query.dtype, device=query.device)  # the q/k norms have no weight
    query, key = qk_norm_rope(query, key, ones, ones, *rope, attn.norm_q.eps)
    out = attention(query, key, value, backend=backend).flatten(2, 3)
    hidden.addcmul_(attn.to_out[0](out), block.scale1)
    normed = _norm(hidden, block.norm2, dtype, fp8)
    ff = block.ff.net[2](swiglu(block.ff.net[0].proj(normed), fp8=fp8))
    return hidden.addcmul_(ff, block.scale2)


def _decoder_forward(
    decoder, latents: torch.Tensor, backend: str, fp8: bool, check: Callable[[], None]
) -> torch.Tensor:
    """`MiniMaxH3VideoViTDecoder3d.forward` for a batch `(B, C, t, h, w)` -> pixels `(B, 3, t * 4, h * 16, w * 16)`."""
    batch, channels, frames, height, width = latents.shape
    tokens = latents.permute(0, 2, 3, 4, 1).reshape(batch, frames * height * width, channels)
    hidden = decoder.proj_in(tokens.to(decoder.proj_in.weight.dtype))
    patches = hidden.shape[1]
    registers = decoder.register_tokens.expand(batch, -1, -1).to(hidden.dtype)
    hidden = torch.cat([hidden, registers, torch.zeros_like(hidden[:, :1])], dim=1).float()
    grids = [
        2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=latents.device) / size) - 1.0
        for size in (frames, height, width)
    ]
    positions = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)
    positions = torch.cat([positions, positions.new_zeros(decoder.num_register_tokens + 1, 3)])[None]
    cos, sin = decoder.rope(positions)  # (1, N, 1, rotary) float32
    rope = (cos[0, :, 0], sin[0, :, 0])
    for block in decoder.transformer_blocks:
        check()
        hidden = _block(block, hidden, rope, latents.dtype, backend, fp8)
    hidden = decoder.norm_out(hidden).to(decoder.proj_out.weight.dtype)
    hidden = decoder.proj_out(hidden)[:, :patches]
    p, pt = decoder.patch_size, decoder.patch_size_t
    hidden = hidden.view(batch, frames, height, width, decoder.out_channels, pt, p, p)
    return hidden.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
        batch, decoder.out_channels, frames * pt, height * p, width * p
    )


def clip_starts(vae, num_latent_frames: int) -> tuple[list[int], int]:
    """The latent start of each clip `_decode` cuts and the repeated latent frames it pads with (its lines
    mirrored: clips of `tokens_chunk_size + token_overlap` frames every `tokens_chunk_size`)."""
    token_drop = vae.config.token_drop
    num_tokens = num_latent_frames + token_drop
    pad_tokens = (-num_tokens) % vae.tokens_chunk_size
    num_chunks = (num_tokens + pad_tokens) // vae.tokens_chunk_size - int(token_drop > 0)
    return [i * vae.tokens_chunk_size for i in range(num_chunks)], pad_tokens


def decode_tiles(vae, height: int, width: int):
    """The latent windows `_decode_clip` cuts (rows x columns) and the pixel overlaps it blends."""
    ratio = vae.spatial_compression_ratio
    if not vae.use_tiling:
        return [[(slice(None), slice(None))]], [], []
    ys, y_lengths, y_overlaps = vae._split_tiles(
        height * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height
    )
    xs, x_lengths, x_overlaps = vae._split_tiles(
        width * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width
    )
    rows = [
        [
            (slice(y // ratio, (y + h) // ratio), slice(x // ratio, (x + w) // ratio))
            for x, w in zip(xs, x_lengths, strict=True)
        ]
        for y, h in zip(ys, y_lengths, strict=True)
    ]
    return rows, y_overlaps, x_overlaps


def _batch_size(device: torch.device, tokens_per_piece: int, batch: int | None) -> int:
    if batch is not None:
        return max(1, batch)
    if device.type != "cuda":
        return _CPU_BATCH
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:  # a process capped below the device's memory (set_per_process_memory_fraction)
        free = min(free, int(get_fraction(device) * total) - torch.cuda.memory_allocated(device))
    return max(1, int(free * 0.6) // (_BYTES_PER_TOKEN * tokens_per_piece))


@torch.no_grad()
def decode(
    vae,
    z: torch.Tensor,
    *,
    tier: str = "lossless",
    attention_backend: str | None = "auto",
    batch: int | None = None,
    check: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Denormalised latents `(1, C, F, h, w)` -> pixels `(1, 3, frames, H, W)` in the decoder's dtype, ImageNet
    normalised, as `vae.decode(z).sample`.

    `tier`: "exact" (diffusers' decode), "lossless" or "fast" (see the module). `batch`: pieces per decoder call
    (default: what fits in 60 % of the device's free memory; 8 on the CPU). `check()` runs before each decoder
    block of each batch (progress and cancellation).
    """
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)} (got {tier!r}).")
    check = check or (lambda: None)
    if tier == "exact":
        return vae.decode(z, return_dict=False)[0]
    z = z.to(vae.post_quant_conv.weight.dtype)
    starts, pad_tokens = clip_starts(vae, z.shape[2])
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    rows, y_overlaps, x_overlaps = decode_tiles(vae, z.shape[-2], z.shape[-1])
    window = vae.tokens_chunk_size + vae.token_overlap
    pieces = [z[:, :, start : start + window, ys, xs] for start in starts for row in rows for ys, xs in row]
    piece_tokens = math.prod(pieces[0].shape[2:]) + vae.decoder.num_register_tokens + 1
    size = _batch_size(z.device, piece_tokens, batch)
    backend = attention_backend if z.is_cuda else "sdpa"
    decoded = []
    for first in range(0, len(pieces), size):
        group = vae.post_quant_conv(torch.cat(pieces[first : first + size]))
        decoded.extend(_decoder_forward(vae.decoder, group, backend, tier == "fast", check).split(1))
    tiles_per_clip = sum(len(row) for row in rows)
    clips = []
    for index in range(len(starts)):
        flat = iter(decoded[index * tiles_per_clip : (index + 1) * tiles_per_clip])
        grid = [[next(flat) for _ in row] for row in rows]
        clips.append(vae._stitch_tiles(grid, y_overlaps, x_overlaps) if vae.use_tiling else grid[0][0])
    return _join_clips(vae, clips, z.shape[2], pad_tokens)


def _join_clips(vae, clips: list[torch.Tensor], padded_frames: int, pad_tokens: int) -> torch.Tensor:
    """Cross-fade consecutive clips over their shared frames and cut the padding, as `_decode` does."""
    token_drop = vae.config.token_drop
    ratio = vae.temporal_compression_ratio
    chunk_num_frames = vae.tokens_chunk_size * ratio
    decoded, overlap = [], None
    for clip in clips:
        for j in range(int(token_drop > 0) + 1):
            chunk = clip[:, :, j * chunk_num_frames : (j + 1) * chunk_num_frames][:, :, vae.frame_pre_padding :]
            if j == 0:
                if overlap is not None:
                    chunk = vae._blend(overlap, chunk, vae.frame_overlap, dim=-3)
                decoded.append(chunk)
            else:
                overlap = chunk
    if overlap is not None:
        decoded.append(overlap)
    video = torch.cat(decoded, dim=2)
    if pad_tokens > 0:
        intra_tail = vae.config.clip_length % ratio
        before = padded_frames - pad_tokens
        pad_frames = sum(
            intra_tail if intra_tail and (before + k) % vae.tokens_chunk_size == 0 else ratio for k in range(pad_tokens)
        )
        video = video[:, :, :-pad_frames]
    return video
