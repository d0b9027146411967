"""The stages after denoising: decode the video, decode the audio, write the MP4.

A plain request that goes to a file runs them overlapped: the frames are converted to yuv420p where they were
decoded and handed to a `ClipWriter`, which encodes them on a worker thread while the audio decodes; then the sound
is added and the file is closed and read back (`h3gen/media`). A clip over 15 s decodes and writes window by window
instead (`long_video.py`).
"""

from pathlib import Path

import numpy as np
import torch

from h3gen.media import BackgroundEncode, MediaInfo, Mp4Writer, rgb_to_yuv420
from h3gen.options import base_tier
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.progress import checkpoints
from h3gen.pipelines.h3.stages import Components, ProgressCallback
from h3gen.pipelines.h3.vae import audio_decoder_units, decode_audio, decode_video, video_decoder_units


def decode_frames(
    parts: Components, latents: torch.Tensor, report: ProgressCallback, *, tier: str, on_device: bool = False
) -> torch.Tensor | np.ndarray:
    """Stage `decode_video`: video latents `(1, C, F, h, w)` -> frames `(F, H, W, 3)` float32 in [0, 1] (a numpy
    array, or with `on_device` a tensor where they were decoded)."""
    report("decode_video", 0, 1)

    def check():
        report("decode_video", 0, 1)

    with parts.on_device(parts.vae), checkpoints(video_decoder_units(parts.vae), check):
        frames = decode_video(parts.vae, latents, tier=base_tier(tier), check=check, on_device=on_device)
    report("decode_video", 1, 1)
    return frames


def decode_sound(parts: Components, latents: torch.Tensor, report: ProgressCallback) -> np.ndarray:
    """Stage `decode_audio`: audio latents `(2, C, A)` -> stereo `(2, S)` float32 in [-1, 1]."""
    report("decode_audio", 0, 1)
    with (
        parts.on_device(parts.audio_vae),
        checkpoints(audio_decoder_units(parts.audio_vae), lambda: report("decode_audio", 0, 1)),
    ):
        audio = decode_audio(parts.audio_vae, latents)
    report("decode_audio", 1, 1)
    return audio


class ClipWriter:
    """Stage `write_mp4` of a plain request: its frames start encoding on a worker thread as soon as they are
    decoded (`start`), the sound joins them when it is decoded (`finish`)."""

    def __init__(self, path, frames: torch.Tensor, *, sample_rate: int, audio_sample_rate: int | None = None):
        """`frames` `(F, H, W, 3)` float32 in [0, 1] on any device; `sample_rate` the sound's, `audio_sample_rate`
        the AAC track's (32000 or 48000; default 32000)."""
        num_frames, height, width, _ = frames.shape
        self.writer = Mp4Writer(
            Path(path),
            width=width,
            height=height,
            fps=geometry.FPS,
            sample_rate=sample_rate,
            audio_sample_rate=audio_sample_rate,
        )
        try:
            self.encoding = BackgroundEncode(self.writer, rgb_to_yuv420(frames).cpu().numpy())
        except BaseException:
            self.writer.abort()
            raise

    def finish(self, audio: np.ndarray, report: ProgressCallback) -> MediaInfo:
        """Wait for the frames, add `audio` `(2, S)`, close the file and read it back; returns what was found."""
        units = 2 * self.encoding.frames
        report("write_mp4", 0, units)
        self.encoding.wait(lambda done: report("write_mp4", done, units))
        self.writer.add_audio(audio)
        media = self.writer.close(progress=lambda done: report("write_mp4", units // 2 + done, units))
        report("write_mp4", units, units)
        return media

    def abort(self) -> None:
        """Stop the encoder and delete the partial file."""
        self.encoding.stop()
        self.writer.abort()
