"""MP4 out: H.264 yuv420p + AAC stereo, muxed with PyAV and verified by decoding it back; the background encode.

Every MP4 h3gen writes is read back before it is handed out: frame count, size, frame rate, audio channels and
sample rate, and the audio and video durations (within one frame of each other). A file that fails is deleted and
the call raises `MediaError`. `BackgroundEncode` runs a writer's `add_frames` on a worker thread, stoppable between
frames.
"""

import functools
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from h3gen.errors import RequestError
from h3gen.media.errors import MediaError, shown_name

AUDIO_RATES = (32000, 48000)
_AUDIO_CHUNK = 1024  # AAC frame size


@dataclass(frozen=True)
class MediaInfo:
    """What decoding an MP4 back found."""

    num_frames: int
    width: int
    height: int
    fps: float
    video_seconds: float
    audio_channels: int
    sample_rate: int
    audio_seconds: float


def _to_uint8_frames(video: np.ndarray) -> np.ndarray:
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must be (frames, height, width, 3), got {video.shape}.")
    if video.dtype == np.uint8:
        return np.ascontiguousarray(video)
    return np.ascontiguousarray((np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8))


def _fit_audio(audio: np.ndarray, num_samples: int) -> np.ndarray:
    """Trim or zero-pad `(2, N)` audio to exactly `num_samples`, so the sound lasts as long as the picture."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"audio must be stereo (2, samples), got {audio.shape}.")
    if audio.shape[1] >= num_samples:
        return np.ascontiguousarray(audio[:, :num_samples])
    return np.pad(audio, ((0, 0), (0, num_samples - audio.shape[1])))


# x264's speed preset. CRF fixes the quality a preset aims at; a faster preset reaches it with fewer encoder tools and
# so spends more bits. On 16 cores a 5 s 768x1344 clip encodes in 0.8 s with "ultrafast" against 2.1 s with
# "veryfast" and 4.7 s with "medium" (benchmarks/RESULTS.md). The encoder uses every core (`threads` 0).
DEFAULT_PRESET = "ultrafast"
NVENC = "h264_nvenc"


@functools.cache
def nvenc_available() -> bool:
    """Whether FFmpeg's NVENC H.264 encoder opens here: PyAV's wheels carry it, and it works where the GPU has a
    video encoder (RTX and most datacenter cards; not the H100 / H200) and the driver's encode library is present.
    Tried once per process on a tiny clip in memory."""
    import av

    if NVENC not in av.codecs_available:
        return False
    try:
        with av.open(io.BytesIO(), mode="w", format="mp4") as container:
            stream = container.add_stream(NVENC, rate=24)
            stream.width, stream.height, stream.pix_fmt = 256, 256, "yuv420p"
            frame = av.VideoFrame.from_ndarray(np.zeros((384, 256), np.uint8), format="yuv420p")
            container.mux(stream.encode(frame))
            container.mux(stream.encode())
        return True
    except Exception:  # no encoder on this GPU, no driver library, no GPU: FFmpeg's errors vary
        return False


def video_encoder() -> str:
    """The H.264 encoder MP4s are written with: NVENC where it works (`nvenc_available`), else x264."""
    return NVENC if nvenc_available() else "libx264"


def rgb_to_yuv420(frames):
    """RGB frames `(F, H, W, 3)` (a torch tensor, float in [0, 1] or uint8, on any device) -> yuv420p planes
    `(F, H * 3 // 2, W)` uint8 on the same device, BT.601 limited range (what FFmpeg's swscale makes of rgb24 by
    default), chroma averaged over 2x2 pixels. On a GPU this replaces the per-frame conversion on the host."""
    import torch

    rgb = frames.float() if frames.dtype != torch.uint8 else frames.float() / 255.0
    rgb = rgb.clamp(0.0, 1.0) * 255.0
    r, g, b = rgb.unbind(-1)
    count, height, width = r.shape
    y = 16.0 + 0.256788 * r + 0.504129 * g + 0.097906 * b
    u = 128.0 - 0.148223 * r - 0.290993 * g + 0.439216 * b
    v = 128.0 + 0.439216 * r - 0.367788 * g - 0.071427 * b

    def half(plane):
        return plane.view(count, height // 2, 2, width // 2, 2).mean(dim=(2, 4))

    chroma = torch.stack([half(u), half(v)], dim=1).reshape(count, height // 2, width)
    return torch.cat([y, chroma], dim=1).round_().clamp_(0, 255).to(torch.uint8)


class Mp4Writer:
    """An MP4 written piece by piece: H.264 yuv420p video (`add_frames`, any number of calls, in order) and AAC
    stereo audio (`add_audio`, once, after or before the frames); `close()` finishes the file, checks it by decoding
    it back (frame count, size, rate, audio channels and rate, durations within one frame) and moves it into place.
    A writer that fails or is `abort()`ed leaves no file. Only the frames of one `add_frames` call are held at a
    time, so a long clip never sits in memory whole.

    `crf` 18 (visually lossless for H.264), `preset` x264's speed preset (default `DEFAULT_PRESET`), all cores.
    `encoder`: "libx264" or "h264_nvenc" (default `video_encoder()`: NVENC where the GPU has it, at constant
    quality `crf`, its fastest preset).
    """

    def __init__(
        self,
        path,
        *,
        width: int,
        height: int,
        fps: int = 24,
        sample_rate: int = 32000,
        audio_sample_rate: int | None = None,
        crf: int = 18,
        preset: str | None = None,
        encoder: str | None = None,
    ):
        import av

        if height % 2 or width % 2:
            raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}.")
        self.out_rate = audio_sample_rate or sample_rate
        if self.out_rate not in AUDIO_RATES:
            raise RequestError(
                f"audio_sample_rate must be one of {AUDIO_RATES} (got {self.out_rate}).", "audio_sample_rate"
            )
        self.path, self.width, self.height, self.fps = Path(path), width, height, fps
        self.sample_rate = sample_rate
        self.num_frames = 0
        self.audio_written = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}-{id(self)}")
        self.container = av.open(str(self.partial), mode="w", format="mp4", options={"movflags": "+faststart"})
        self.encoder = encoder or video_encoder()
        self.video_stream = self.container.add_stream(self.encoder, rate=fps)
        self.video_stream.width, self.video_stream.height = width, height
        self.video_stream.pix_fmt = "yuv420p"
        if self.encoder == NVENC:
            self.video_stream.options = {"rc": "vbr", "cq": str(crf), "preset": preset or "p1"}
        else:
            self.video_stream.options = {"crf": str(crf), "preset": preset or DEFAULT_PRESET, "threads": "0"}
        self.audio_stream = self.container.add_stream("aac", rate=self.out_rate, layout="stereo")
        self.audio_stream.bit_rate = 192_000

    def add_frames(self, frames: np.ndarray, progress: Callable[[int], None] | None = None) -> None:
        """Encode `(n, H, W, 3)` RGB frames (float in [0, 1] or uint8) or `(n, H * 3 // 2, W)` uint8 yuv420p planes
        (`rgb_to_yuv420`). `progress(frames written so far)` runs after each frame."""
        import av

        planar = frames.ndim == 3
        if planar:
            if frames.shape[1:] != (self.height * 3 // 2, self.width) or frames.dtype != np.uint8:
                raise ValueError(
                    f"yuv420p planes must be uint8 (n, {self.height * 3 // 2}, {self.width}), got "
                    f"{frames.dtype} {frames.shape}."
                )
        else:
            frames = _to_uint8_frames(frames)
            if frames.shape[1:3] != (self.height, self.width):
                raise ValueError(f"frames must be {self.width}x{self.height}, got {frames.shape[2]}x{frames.shape[1]}.")
        for frame in frames:
            picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="yuv420p" if planar else "rgb24")
            self.container.mux(self.video_stream.encode(picture))
            self.num_frames += 1
            if progress is not None:
                progress(self.num_frames)

    def add_audio(self, audio: np.ndarray, num_frames: int | None = None) -> None:
        """Encode `(2, N)` float audio in [-1, 1] at `sample_rate`, trimmed or zero-padded to last as long as
        `num_frames` video frames (default: the frames written so far)."""
        import av

        frames = self.num_frames if num_frames is None else num_frames
        audio = _fit_audio(audio, round(frames * self.sample_rate / self.fps))
        resampler = av.AudioResampler(format="fltp", layout="stereo", rate=self.out_rate)
        for start in range(0, audio.shape[1], _AUDIO_CHUNK):
            chunk = np.ascontiguousarray(audio[:, start : start + _AUDIO_CHUNK])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate = self.sample_rate
            frame.pts = start
            frame.time_base = Fraction(1, self.sample_rate)
            for resampled in resampler.resample(frame):
                self.container.mux(self.audio_stream.encode(resampled))
        for resampled in resampler.resample(None):
            self.container.mux(self.audio_stream.encode(resampled))
        self.container.mux(self.audio_stream.encode())
        self.audio_written = True

    def close(self, verify: bool = True, progress: Callable[[int], None] | None = None) -> MediaInfo | None:
        """Flush, check by decoding back (`verify`; `progress(frames decoded)` per frame) and move into place."""
        try:
            if not self.audio_written:
                raise ValueError("an MP4 needs its audio: call add_audio before close.")
            self.container.mux(self.video_stream.encode())
            self.container.close()
            info = None
            if verify:
                info = probe_mp4(self.partial, on_frame=progress)
                check_mp4(
                    info,
                    num_frames=self.num_frames,
                    width=self.width,
                    height=self.height,
                    fps=self.fps,
                    sample_rate=self.out_rate,
                )
            self.partial.replace(self.path)
            return info
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Stop and remove the partial file."""
        try:
            self.container.close()
        except Exception:  # already closed, or broken by the failure being handled
            pass
        self.partial.unlink(missing_ok=True)


def write_mp4(
    path,
    video: np.ndarray,
    audio: np.ndarray,
    *,
    fps: int = 24,
    sample_rate: int = 32000,
    audio_sample_rate: int | None = None,
    crf: int = 18,
    preset: str | None = None,
    verify: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> MediaInfo | None:
    """Write an MP4 with H.264 video and AAC stereo audio, then (by default) check it by decoding it back
    (`Mp4Writer` in one go).

    Args:
        path: output file; written to a temporary name first and moved into place only when complete.
        video: `(F, H, W, 3)` float in [0, 1] (or uint8); H and W must be even.
        audio: `(2, N)` float in [-1, 1] at `sample_rate`; trimmed or padded to the video's duration.
        audio_sample_rate: rate of the AAC stream, 32000 or 48000 (default: `sample_rate`); resampled if different.
        progress: `progress(done, total)` after each video frame encoded (and decoded back, when `verify`): a
            cancellation point; an exception it raises stops the write and removes the partial file.
    Returns:
        `MediaInfo` of the decoded file when `verify`.
    """
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video must be (frames, height, width, 3), got {video.shape}.")
    num_frames, height, width, _ = video.shape
    writer = Mp4Writer(
        path,
        width=width,
        height=height,
        fps=fps,
        sample_rate=sample_rate,
        audio_sample_rate=audio_sample_rate,
        crf=crf,
        preset=preset,
    )
    units = num_frames * (2 if verify else 1)
    try:
        writer.add_frames(video, None if progress is None else (lambda done: progress(done, units)))
        writer.add_audio(audio)
    except BaseException:
        writer.abort()
        raise
    return writer.close(verify, None if progress is None else (lambda done: progress(num_frames + done, units)))


def probe_mp4(path, on_frame: Callable[[int], None] | None = None) -> MediaInfo:
    """Decode an MP4 fully and report what it holds (raises `MediaError` if it cannot be decoded). `on_frame(count)`
    runs after each decoded video frame."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{shown_name(path)} has no video stream.")
            video_stream = container.streams.video[0]
            video_stream.thread_type = "AUTO"  # decode with every core
            fps = float(video_stream.average_rate or video_stream.guessed_rate or 0)
            num_frames, width, height = 0, video_stream.codec_context.width, video_stream.codec_context.height
            for _ in container.decode(video=0):
                num_frames += 1
                if on_frame is not None:
                    on_frame(num_frames)
        channels, rate, samples = 0, 0, 0
        with av.open(str(path)) as container:
            if container.streams.audio:
                audio_stream = container.streams.audio[0]
                channels, rate = audio_stream.codec_context.channels, audio_stream.codec_context.sample_rate
                for frame in container.decode(audio=0):
                    samples += frame.samples
    except av.error.FFmpegError as error:
        raise MediaError(f"{shown_name(path)} does not decode: {error}") from None
    return MediaInfo(
        num_frames=num_frames,
        width=width,
        height=height,
        fps=fps,
        video_seconds=num_frames / fps if fps else 0.0,
        audio_channels=channels,
        sample_rate=rate,
        audio_seconds=samples / rate if rate else 0.0,
    )


def check_mp4(info: MediaInfo, *, num_frames: int, width: int, height: int, fps: int, sample_rate: int) -> None:
    """Raise `MediaError` unless the decoded file matches what was written (durations within one frame)."""
    problems = []
    if info.num_frames != num_frames:
        problems.append(f"{info.num_frames} frames instead of {num_frames}")
    if (info.width, info.height) != (width, height):
        problems.append(f"size {info.width}x{info.height} instead of {width}x{height}")
    if abs(info.fps - fps) > 1e-3:
        problems.append(f"{info.fps:g} fps instead of {fps}")
    if info.audio_channels != 2:
        problems.append(f"{info.audio_channels} audio channels instead of 2")
    if info.sample_rate != sample_rate:
        problems.append(f"audio at {info.sample_rate} Hz instead of {sample_rate}")
    if abs(info.audio_seconds - info.video_seconds) > 1.0 / fps:
        problems.append(f"audio lasts {info.audio_seconds:.3f} s but video {info.video_seconds:.3f} s")
    if problems:
        raise MediaError("MP4 check failed: " + "; ".join(problems) + ".")


class BackgroundEncode:
    """A writer's `add_frames` on a worker thread, stoppable between frames."""

    def __init__(self, writer: Mp4Writer, frames: np.ndarray):
        self.frames, self.done = len(frames), 0
        self._stopping = threading.Event()
        self._future = ThreadPoolExecutor(1, thread_name_prefix="h3gen-mp4").submit(
            writer.add_frames, frames, self._progress
        )

    def _progress(self, done: int) -> None:
        self.done = done
        if self._stopping.is_set():
            raise InterruptedError("the MP4 write was stopped")

    def wait(self, report: Callable[[int], None]) -> None:
        """Block until every frame is encoded, calling `report(frames encoded)` every 50 ms meanwhile (a
        cancellation point); re-raises the encoder's error."""
        while True:
            try:
                return self._future.result(timeout=0.05)
            except FutureTimeout:
                report(self.done)

    def stop(self) -> None:
        """Stop after the frame being encoded and wait for the worker (its error, if any, is dropped)."""
        self._stopping.set()
        try:
            self._future.result()
        except BaseException:  # the stop itself, or the encoder's own failure: the caller is failing already
            pass
