"""Running a continuation request (a clip longer than 15 s, `pipelines/h3/continuation.py`) through an `H3Pipeline`,
window by window, with memory bounded by one window.

Each window is a request of its own length made with the pipeline's own stages: its prompt (with the first keyframe
on the first window and the last keyframe on the last, or the references on every window) is encoded, its noise is
drawn from the request's one generator in the plain request's order (conditions, video, audio), then the guide's
noise; the previous window's latent tail becomes condition rows (video noised to t = 0.999 like every visual
condition, audio clean at t = 1, as the layout treats references and vLLM-Omni its `latent_guide`) at the window's
first positions; the window's media positions are shifted by its start onto the clip's timeline. The first window
is therefore exactly the plain request of its length with the same seed.

After sampling, the window's overlap is discarded and its new latents are decoded at once (`vae_stream`: the video
VAE's own chunks and cross-fades, batched per window; the audio decoder in fixed stretches with context on both
sides) and the frames written to the MP4 (`media.Mp4Writer`, 17 frames at a time, converted to yuv420p where they
were decoded), so no more than a window of latents and of decoded frames is held; the sound (8 MB a minute) is
written once at the end.

Progress: `callback("window", i, n)` before window `i` (and `("window", n, n)` at the end), then the window's own
stages as a plain request reports them, each window's `decode_video` (which writes each chunk as it is decoded) and
`decode_audio` included; `write_mp4` once at the end (the file finished and read back).
Each media row's time within a window starts at that window's own text length (not the longest prompt's, as
vLLM-Omni anchors it): what a window sees equals a plain request shifted in time, which keeps the first window exact.
"""

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from h3gen.errors import RequestError
from h3gen.media import Mp4Writer, rgb_to_yuv420
from h3gen.pipelines.h3.continuation import Window, window_geometry
from h3gen.pipelines.h3.packing import patchify_video
from h3gen.pipelines.h3.progress import checkpoints
from h3gen.pipelines.h3.request import KEYFRAME_NOISE_AUG, H3Request
from h3gen.pipelines.h3.schedules import noise_to
from h3gen.pipelines.h3.stages import Components, denoise, draw, draw_noise, encode_conditions, encode_text, pack
from h3gen.pipelines.h3.vae import audio_decoder_units, video_decoder_units
from h3gen.pipelines.h3.vae_stream import AudioDecodeStream, VideoDecodeStream


def window_request(request: H3Request, window: Window, last: bool) -> H3Request:
    """The plain request one window is: its prompt, its keyframes (fl2va: the first on the first window, the last on
    the last one), the references (every window), its own geometry, the request's generator."""
    plan = request.continuation
    keep = [
        i
        for i, anchor in enumerate(request.anchors)
        if (anchor == "first" and window.index == 0) or (anchor == "last" and last)
    ]
    return replace(
        request,
        prompt=plan.prompts[window.index],
        keyframes=[request.keyframes[i] for i in keep],
        anchors=tuple(request.anchors[i] for i in keep),
        shape=window_geometry(request.shape, window),
        latents=None,
        audio_latents=None,
        continuation=None,
    )


def largest_window(request: H3Request) -> H3Request:
    """The plain request a continuation's largest window packs as many rows as: the first window's length plus the
    guide rows the next windows carry (for a GPU budget check)."""
    windows = request.continuation.windows
    sub = window_request(request, windows[0], last=len(windows) == 1)
    guide = windows[1] if len(windows) > 1 else windows[0]
    shape = replace(
        sub.shape,
        num_latent_frames=sub.shape.num_latent_frames + guide.overlap_latent_frames,
        num_audio_latents=sub.shape.num_audio_latents + guide.overlap_audio_latents,
    )
    return replace(sub, shape=shape)


def window_layout(request: H3Request, window: Window, text, blocks, patch_size):
    """The packed layout of one window: the plain layout of its length, its media shifted to the window's start, and
    the guide's rows (the previous window's tail) on the window's first positions."""
    return pack(
        request,
        text,
        blocks,
        patch_size,
        media_offset=window.temporal_offset,
        guide_frames=window.overlap_latent_frames,
        guide_audio_latents=window.overlap_audio_latents,
    )


def _with_guide(rows: torch.Tensor, num_targets: int, guide: torch.Tensor) -> torch.Tensor:
    """`[conditions | targets]` rows -> `[conditions | guide | targets]`."""
    split = rows.shape[0] - num_targets
    return torch.cat([rows[:split], guide.to(rows.dtype), rows[split:]])


class _Timings:
    """Seconds per stage, summed over the windows."""

    def __init__(self):
        import time

        self.clock = time.perf_counter
        self.started = self.clock()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = self.clock()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.started
        self.started = now


def run_continuation(
    parts: Components,
    transformer,
    request: H3Request,
    *,
    report,
    tier: str,
    decode: bool,
    output_path,
    audio_sample_rate: int | None = None,
    preview=None,
):
    """Make a continuation request with the stages on `parts` and `transformer` (its adapters already active):
    returns `(MediaInfo of the written MP4 or None, timings)`. With `decode` the clip is streamed to `output_path`;
    without it (the other ranks of a parallel run) nothing is decoded or written. `preview` (a `preview.PreviewMaker`)
    previews the window being made."""
    plan = request.continuation
    if decode and output_path is None:
        raise RequestError(
            "a clip longer than 15 s is written to a file as it is made: pass output_path.", "output_path"
        )
    cfg, timings = parts.config, _Timings()
    windows, total = plan.windows, plan.num_windows
    texts = {}
    writer = video_stream = audio_stream = None
    if decode:
        shape = request.shape
        writer = Mp4Writer(
            Path(output_path),
            width=shape.width,
            height=shape.height,
            sample_rate=parts.sample_rate,
            audio_sample_rate=audio_sample_rate,
        )
        video_stream = VideoDecodeStream(parts.vae, tier=tier, check=lambda: report("decode_video", 0, 1))
        audio_stream = AudioDecodeStream(parts.audio_vae)
    sounds = []
    tail_video = tail_audio = None
    try:
        for window in windows:
            report("window", window.index, total)
            sub = window_request(request, window, last=window.index == total - 1)
            key = (sub.prompt, sub.anchors)
            if key not in texts:  # one encoding per distinct prompt (and keyframe)
                texts = {key: encode_text(parts, sub, report)}
            text = texts[key]
            timings.lap("encode_text")
            rows = encode_conditions(parts, sub, draw_noise(parts, sub), report)
            if window.overlap:
                guide = noise_to(
                    tail_video, KEYFRAME_NOISE_AUG, draw(parts, tuple(tail_video.shape), request.generator)
                )
                targets = (
                    sub.shape.num_latent_frames
                    * (sub.shape.latent_height // cfg.patch_size[1])
                    * (sub.shape.latent_width // cfg.patch_size[2])
                )
                rows.video = _with_guide(rows.video, targets, patchify_video(guide, cfg.patch_size))
                guide_audio = tail_audio.permute(0, 2, 1).reshape(-1, cfg.audio_in_channels)  # (2A, C) channel-major
                rows.audio = _with_guide(rows.audio, 2 * sub.shape.num_audio_latents, guide_audio)
            timings.lap("encode_conditions")
            layout = window_layout(sub, window, text, rows.blocks, cfg.patch_size)
            if preview is not None:
                preview.window = (window.index, total)
            made = denoise(
                transformer, sub, text, rows, layout, report, device=parts.device, tier=tier, preview=preview
            )
            video, audio = made.video, made.audio
            timings.lap("denoise")
            if window.index + 1 < total:
                following = windows[window.index + 1]
                tail_video = video[:, :, video.shape[2] - following.overlap_latent_frames :].clone()
                tail_audio = audio[..., audio.shape[-1] - following.overlap_audio_latents :].clone()
            video, audio = video[:, :, window.overlap_latent_frames :], audio[..., window.overlap_audio_latents :]
            if decode:
                sounds.append(
                    _decode_window(
                        parts,
                        video_stream,
                        audio_stream,
                        writer,
                        video,
                        audio,
                        last=window.index == total - 1,
                        report=report,
                        timings=timings,
                    )
                )
            del video, audio, rows, made
        report("window", total, total)
        info = None
        if decode:
            report("write_mp4", 0, 1)
            writer.add_audio(np.concatenate(sounds, axis=1), num_frames=request.shape.num_frames)
            info = writer.close(progress=lambda done: report("write_mp4", done, request.shape.num_frames))
            report("write_mp4", 1, 1)
            timings.lap("write_mp4")
            writer = None
        return info, timings.seconds
    finally:
        if writer is not None:
            writer.abort()


def _write_frames(writer, frames: torch.Tensor) -> None:
    """Frames `(F, H, W, 3)` in [0, 1] where they were decoded -> the MP4, 17 at a time as yuv420p planes."""
    for start in range(0, frames.shape[0], 17):
        writer.add_frames(rgb_to_yuv420(frames[start : start + 17]).cpu().numpy())


def _decode_window(parts: Components, video_stream, audio_stream, writer, video, audio, *, last: bool, report, timings):
    """Stages `decode_video` and `decode_audio` of one window's new latents: the frames are written to the MP4 as
    they are decoded (the encoder's time counts in `decode_video`); returns the sound they settle `(2, S)`
    (everything that is left, for the last window)."""
    report("decode_video", 0, 1)
    with parts.on_device(parts.vae), checkpoints(video_decoder_units(parts.vae), lambda: report("decode_video", 0, 1)):
        for frames in video_stream.chunks(video):
            _write_frames(writer, frames)
        if last:
            _write_frames(writer, video_stream.finish())
    report("decode_video", 1, 1)
    timings.lap("decode_video")
    report("decode_audio", 0, 1)
    with (
        parts.on_device(parts.audio_vae),
        checkpoints(audio_decoder_units(parts.audio_vae), lambda: report("decode_audio", 0, 1)),
    ):
        sound = audio_stream.push(audio)
        if last:
            sound = np.concatenate([sound, audio_stream.finish()], axis=1)
    report("decode_audio", 1, 1)
    timings.lap("decode_audio")
    return sound
