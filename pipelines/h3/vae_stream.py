"""Decoding a latent timeline that arrives in pieces (a long clip, window by window), with memory bounded by a piece.

Video: diffusers' `AutoencoderKLMiniMaxH3._decode` already decodes a clip as independent temporal chunks: chunk `i`
decodes latents `[5i, 5i + 7)` (five of its own plus the two the next chunk starts with) into 17 frames and a 5-frame
tail, and the tail is cross-faded into the next chunk's first 5 frames. `VideoDecodeStream` decodes the chunks each
new stretch of latents completes (batched, `video_decode.decode`) and cross-fades the first of them with the tail
the previous stretch left, so its frames equal one `decode_video` of the whole timeline (bit for bit in the exact
tier); it holds one stretch's chunks, at most two latent frames beyond them and one 5-frame tail.

Audio: the BigVGAN decoder is convolutional, so a sample depends on latents within a fixed reach. `AudioDecodeStream`
decodes the timeline in stretches of a fixed length, each together with `context` latents on both sides, and keeps
only the stretch itself, so its waveform equals one decode of the whole timeline up to float rounding, with no seam
where the pieces meet. The fixed length keeps both the decoder's working memory and the set of input shapes its
convolutions see (each shape costs the CPU backend cached kernels) the same for a clip of any length.
"""

import math

import numpy as np
import torch

from h3gen.pipelines.h3 import video_decode
from h3gen.pipelines.h3.vae import PIXEL_MEAN, PIXEL_STD, decode_audio


def _stat(values, device) -> torch.Tensor:
    return torch.tensor(values, device=device).view(1, -1, 1, 1, 1)


# Taps of the anti-aliasing filters around each of the decoder's activations (diffusers' MiniMaxH3AudioActivation1d).
_ACTIVATION_TAPS = 12


def audio_decoder_reach(config) -> int:
    """How many latents on either side of a latent the audio decoder's output for it depends on (an upper bound,
    from the decoder's kernels, dilations and upsampling rates in `config`), plus a margin of half again."""
    rates = [int(rate) for rate in config.decoder_rates]
    kernels = [int(kernel) for kernel in config.decoder_kernel_sizes]
    widest = max(int(kernel) for kernel in config.resblock_kernel_sizes)
    dilations = max((tuple(int(d) for d in group) for group in config.resblock_dilation_sizes), key=sum)
    # One resblock stack at one rate, in output samples: each dilation's conv pair and its two activations.
    stack = sum((widest - 1) * d // 2 + (widest - 1) // 2 + 2 * _ACTIVATION_TAPS for d in dilations)
    reach, scale = 3.0 + 1.0, 1  # conv_pre (kernel 7) and the 1x1 input projection, at the latent rate
    for rate, kernel in zip(rates, kernels, strict=True):
        reach += math.ceil(kernel / rate) / scale  # the transposed conv, in its input samples
        scale *= rate
        reach += stack / scale
    reach += (3 + _ACTIVATION_TAPS) / scale  # activation_post and conv_post at the output rate
    return math.ceil(reach * 1.5)


class VideoDecodeStream:
    """Frames of a latent timeline fed with `chunks` in order; `finish` returns the last frames. Each call decodes
    every whole chunk its latents complete in one batched decode (`video_decode.decode` at `tier`, at most
    `max_chunks` chunks at a time) and yields them as `(frames, H, W, 3)` float32 in [0, 1], on the VAE's device."""

    def __init__(self, vae, tier: str = "exact", check=None, max_chunks: int = 16):
        self.vae, self.tier, self.check, self.max_chunks = vae, tier, check, max_chunks
        self.chunk = vae.tokens_chunk_size  # latent frames each chunk owns (5)
        self.lookahead = vae.token_overlap  # latent frames of the next chunk it also decodes (2)
        self.pending: torch.Tensor | None = None  # latents not yet decoded as a chunk's own
        self.tail: torch.Tensor | None = None  # the previous chunk's decoded tail, to cross-fade

    def _pixels(self, decoded: torch.Tensor) -> torch.Tensor:
        video = (decoded.float() * _stat(PIXEL_STD, decoded.device) + _stat(PIXEL_MEAN, decoded.device)).clamp(0, 1)
        return video[0].permute(1, 2, 3, 0)

    @torch.no_grad()
    def chunks(self, latents: torch.Tensor):
        """Add normalised latents `(1, C, F, h, w)` (the next stretch of the timeline) and yield the frames of every
        chunk they complete (a generator: decoded when asked for)."""
        vae = self.vae
        self.pending = latents if self.pending is None else torch.cat([self.pending, latents], dim=2)
        while self.pending.shape[2] >= self.chunk + self.lookahead:
            count = min((self.pending.shape[2] - self.lookahead) // self.chunk, self.max_chunks)
            z = self.pending[:, :, : count * self.chunk + self.lookahead]
            z = z * _stat(vae.config.latents_std, z.device) + _stat(vae.config.latents_mean, z.device)
            decoded = video_decode.decode(vae, z, tier=self.tier, check=self.check)  # 17 count + 5 frames
            if self.tail is not None:
                decoded = vae._blend(self.tail, decoded, vae.frame_overlap, dim=-3)
            own = decoded.shape[2] - vae.frame_overlap
            self.tail = decoded[:, :, own:]
            self.pending = self.pending[:, :, count * self.chunk :]
            yield self._pixels(decoded[:, :, :own])

    def push(self, latents: torch.Tensor) -> np.ndarray:
        """`chunks` as one host array."""
        out = [frames.cpu().numpy() for frames in self.chunks(latents)]
        return np.concatenate(out) if out else np.zeros((0, 0, 0, 3), dtype=np.float32)

    def finish(self) -> torch.Tensor:
        """The last chunk's tail (the timeline's final frames). The latents given must have made 5n + 2."""
        if self.pending is None or self.pending.shape[2] != self.lookahead or self.tail is None:
            raise ValueError("the latents given do not make a 5n + 2 timeline.")
        frames, self.tail, self.pending = self._pixels(self.tail), None, None
        return frames


AUDIO_STRETCH = 512  # audio latents decoded per call (12.8 s), besides the context on both sides


class AudioDecodeStream:
    """The stereo waveform of audio latents fed with `push` in order; `finish` returns the rest. Every call returns
    `(2, samples)` float32 numpy (possibly zero samples); `context` latents on each side make each piece's samples
    those of one whole decode; `stretch` latents are decoded per call."""

    def __init__(self, vae, context: int | None = None, stretch: int = AUDIO_STRETCH):
        self.vae = vae
        self.context = audio_decoder_reach(vae.config) if context is None else context
        self.stretch = stretch
        self.hop = int(np.prod(vae.config.decoder_rates))
        self.buffer: torch.Tensor | None = None  # normalised latents (2, C, n) from `offset` on
        self.offset = 0  # timeline index of buffer[..., 0]
        self.done = 0  # timeline latents whose samples were returned

    def _decode(self, stop: int) -> np.ndarray:
        """Samples of latents [done, stop), decoded with context on both sides, and drop what is no longer needed."""
        if stop <= self.done:
            return np.zeros((2, 0), dtype=np.float32)
        end = self.offset + self.buffer.shape[-1]
        lo, hi = max(self.offset, self.done - self.context), min(end, stop + self.context)
        wave = decode_audio(self.vae, self.buffer[..., lo - self.offset : hi - self.offset])
        out = wave[:, (self.done - lo) * self.hop : (stop - lo) * self.hop]
        self.done = stop
        keep = max(self.offset, self.done - self.context)
        self.buffer, self.offset = self.buffer[..., keep - self.offset :], keep
        return np.ascontiguousarray(out)

    def _end(self) -> int:
        return self.offset + self.buffer.shape[-1]

    @staticmethod
    def _joined(pieces: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(pieces, axis=1) if pieces else np.zeros((2, 0), dtype=np.float32)

    @torch.no_grad()
    def push(self, latents: torch.Tensor) -> np.ndarray:
        """Add normalised audio latents `(2, C, A)`; return the samples of every whole stretch whose right context
        is in (no later latent can change them)."""
        self.buffer = latents if self.buffer is None else torch.cat([self.buffer, latents], dim=-1)
        pieces = []
        while self._end() >= self.done + self.stretch + self.context:
            pieces.append(self._decode(self.done + self.stretch))
        return self._joined(pieces)

    @torch.no_grad()
    def finish(self) -> np.ndarray:
        """The samples of every latent not yet returned."""
        pieces = []
        while self.buffer is not None and self.done < self._end():
            pieces.append(self._decode(min(self.done + self.stretch, self._end())))
        return self._joined(pieces)
