"""Previews while a clip is denoised: every few forwards, a picture of the clip as it will come out.

The picture is exact for what the loop predicts at that forward: the current prediction of the clean latents (flow
matching, t = 1 - sigma: x0 = x_t + sigma * v, `schedules.FlowSchedule.step`'s own `denoised`) through the video VAE.
Only one decoder clip is decoded, not the whole video: the `tokens_chunk_size + token_overlap` latent frames (5 + 2)
around the middle of the clip (a clip start on the decoder's 5-latent grid), every spatial tile of them, which is the
same decoder input the final decode gives that stretch; the preview is the middle frame of it, a frame no cross-fade
touches, so it equals that frame of the final decode of the same latents. A 5 s clip has seven decoder clips, so a
preview costs about a seventh of the video decode.

Cadence: `preview_every` forwards (`GenerationRequest.preview_every`), or by default about every tenth of the
request's forwards and at least every `MAX_SECONDS_BETWEEN` seconds of denoising; never after the last forward (the
real decode follows it). A clip over 15 s previews the window being made. Rank 0 only: the other ranks of a parallel
run decode nothing.

A preview reaches the caller as `callback(PREVIEW, forward, forwards, preview)` (`progress.PREVIEW`), only for a
callback that takes that fourth argument: no listener, no decode.
"""

import inspect
import io
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from h3gen.errors import RequestError
from h3gen.options import base_tier
from h3gen.pipelines.h3.generation import MAX_PREVIEW_EVERY
from h3gen.pipelines.h3.progress import PREVIEW
from h3gen.pipelines.h3.vae import decode_video

PREVIEWS_PER_REQUEST = 10  # default cadence: about every tenth of the forwards
MAX_SECONDS_BETWEEN = 30.0  # ... and at least this often while denoising
JPEG_QUALITY = 85


@dataclass(frozen=True)
class Preview:
    """One preview. `image` `(H, W, 3)` uint8 RGB at the clip's canvas; `forward` the forwards done when it was made
    (1-based) of `forwards` (the window's, for a clip over 15 s); `window` `(index, count)` of a clip over 15 s,
    else None; `seconds` what making it took (decode and copy to the host)."""

    image: np.ndarray
    forward: int
    forwards: int
    window: tuple[int, int] | None = None
    seconds: float = 0.0

    def jpeg(self, quality: int = JPEG_QUALITY) -> bytes:
        """The picture as JPEG bytes."""
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(self.image).save(buffer, format="JPEG", quality=quality)
        return buffer.getvalue()

    def describe(self) -> dict:
        """What a job's status says of it: forward, forwards, window (or None)."""
        window = None if self.window is None else list(self.window)
        return {"forward": self.forward, "forwards": self.forwards, "window": window}


def default_interval(forwards: int) -> int:
    """The default cadence in forwards: about a tenth of `forwards`, at least 1."""
    return max(1, round(forwards / PREVIEWS_PER_REQUEST))


def check_preview_every(value) -> None:
    """`preview_every` is None (the default cadence) or an integer from 0 (no previews) to `MAX_PREVIEW_EVERY`."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PREVIEW_EVERY:
        raise RequestError(
            f"preview_every must be an integer from 0 (no previews) to {MAX_PREVIEW_EVERY} forwards (got {value!r}).",
            "preview_every",
        )


def accepts_previews(callback) -> bool:
    """Whether `callback` takes a fourth argument (a `Preview`), so that previews are worth making for it."""
    if callback is None:
        return False
    try:
        inspect.signature(callback).bind("preview", 0, 1, None)
    except (TypeError, ValueError):
        return False
    return True


def preview_slice(latents: torch.Tensor, chunk: int, lookahead: int) -> torch.Tensor:
    """The latent frames one preview decodes of `(1, C, F, h, w)`: the decoder clip (`chunk + lookahead` frames,
    starting on the `chunk` grid) nearest the middle of the clip, or all of them when there are no more."""
    span = chunk + lookahead
    frames = latents.shape[2]
    if frames <= span:
        return latents
    start = chunk * min((frames // 2) // chunk, (frames - span) // chunk)
    return latents[:, :, start : start + span]


def preview_image(vae, latents: torch.Tensor, tier: str) -> np.ndarray:
    """Normalised video latents `(1, C, F, h, w)` -> the preview picture `(H, W, 3)` uint8: the middle frame of the
    decoder clip `preview_slice` picks, decoded as the `tier`'s final decode does."""
    piece = preview_slice(latents, vae.tokens_chunk_size, vae.token_overlap)
    frames = decode_video(vae, piece, tier=base_tier(tier), on_device=True)
    frame = frames[frames.shape[0] // 2]
    return (frame * 255.0 + 0.5).clamp(0, 255).to(torch.uint8).cpu().numpy()


class PreviewMaker:
    """The denoising loop's preview hook for one request: `due(forward, forwards)` says whether to make one after
    that forward, `make(latents, forward, forwards)` decodes it and hands the `Preview` to `deliver`.

    `parts` are the pipeline's `stages.Components`; `every`: the request's `preview_every` (None: the default
    cadence; 0 is no maker at all). `count` and `seconds` add up the previews made and their time."""

    def __init__(
        self,
        parts,
        *,
        tier: str,
        every: int | None,
        deliver: Callable[[Preview], None],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.parts, self.tier, self.every, self.deliver, self.clock = parts, tier, every, deliver, clock
        self.window: tuple[int, int] | None = None
        self.count, self.seconds = 0, 0.0
        self.last = clock()

    def begin(self) -> None:
        """A denoising loop starts: the time between previews is counted from here. (A clip over 15 s sets `window`,
        `(index, count)`, before each window's loop.)"""
        self.last = self.clock()

    def due(self, forward: int, forwards: int) -> bool:
        """Whether to make a preview after `forward` (1-based) of `forwards`."""
        if forward >= forwards:
            return False
        if self.every is not None:
            return forward % self.every == 0
        return forward % default_interval(forwards) == 0 or self.clock() - self.last >= MAX_SECONDS_BETWEEN

    def make(self, latents: torch.Tensor, forward: int, forwards: int) -> None:
        """Decode the preview of clean-latent prediction `latents` `(1, C, F, h, w)` and deliver it."""
        if self.parts.device.type == "cuda":  # its own time, not the forward's work still queued before it
            torch.cuda.synchronize(self.parts.device)
        started = self.clock()
        with self.parts.on_device(self.parts.vae):
            image = preview_image(self.parts.vae, latents.to(self.parts.device), self.tier)
        seconds = self.clock() - started
        self.count, self.seconds = self.count + 1, self.seconds + seconds
        self.deliver(Preview(image, forward, forwards, self.window, seconds))
        self.last = self.clock()


def preview_maker(parts, callback, spec, *, tier: str, decode: bool) -> PreviewMaker | None:
    """The previews of one `H3Pipeline.run` call of request `spec` (a `GenerationRequest`): made on a rank that
    decodes, for a callback that takes them (`callback(PREVIEW, forward, forwards, preview)`), unless the request asks
    for none (`preview_every=0`). Under stage or layer-wise offload (`parts.offload`) only a request that sets
    `preview_every` gets them: each brings the video VAE to the GPU between forwards and stalls the block stream (on
    an H100 in the 32 GB profile, 4.6 s a preview and an 8-forward request 61 % longer)."""
    if not decode or spec.preview_every == 0 or not accepts_previews(callback):
        return None
    if spec.preview_every is None and getattr(parts, "offload", "none") != "none":
        return None

    def deliver(preview: Preview) -> None:
        callback(PREVIEW, preview.forward, preview.forwards, preview)

    return PreviewMaker(parts, tier=tier, every=spec.preview_every, deliver=deliver)
