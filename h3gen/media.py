"""MP4 in and out: H.264 yuv420p + AAC stereo, muxed with PyAV and verified by decoding it back; keyframe images.

Every MP4 h3gen writes is read back before it is handed out: frame count, size, frame rate, audio channels and
sample rate, and the audio and video durations (within one frame of each other). A file that fails is deleted and
the call raises `MediaError`.
"""

import functools
import io
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from h3gen.errors import RequestError

AUDIO_RATES = (32000, 48000)
_AUDIO_CHUNK = 1024  # AAC frame size


class MediaError(RuntimeError):
    """An MP4 could not be written or did not decode back as written."""


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
                raise MediaError(f"{_shown(path)} has no video stream.")
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
        raise MediaError(f"{_shown(path)} does not decode: {error}") from None
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


# Most pixels an input image (or a reference video's frame) may hold: 40 MP, above any camera still or 8K frame, and
# 160 MB as RGB. Checked from the file's header before a pixel is decoded, so a small file that claims a huge canvas
# (a decompression bomb) costs nothing. The server, the UI, the CLI and the Python API all read images through here.
MAX_IMAGE_PIXELS = 40_000_000

# What an upload's content decodes as, by field kind: container/format name -> the suffix it is stored under.
IMAGE_FORMATS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff"}
VIDEO_FORMATS = {
    "mov,mp4,m4a,3gp,3g2,mj2": ".mp4",
    "matroska,webm": ".mkv",
    "avi": ".avi",
    "mpegts": ".ts",
    "mpeg": ".mpg",
}
AUDIO_FORMATS = {
    "wav": ".wav",
    "mp3": ".mp3",
    "flac": ".flac",
    "ogg": ".ogg",
    "aac": ".aac",
    "mov,mp4,m4a,3gp,3g2,mj2": ".m4a",
    "matroska,webm": ".mka",
}


def _shown(path) -> str:
    """How a message names a file: its name only, never the folder it lies in (a server's paths stay private)."""
    return Path(path).name


def _pixel_cap_error(field: str, size: str) -> RequestError:
    return RequestError(f"{field} is {size}; images may hold at most {MAX_IMAGE_PIXELS / 1e6:g} MP.", field)


def _open_image(path):
    """`PIL.Image.open` (header only) without PIL's own bomb warning: the caller checks the pixel count itself."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(path)


def check_pixels(width: int, height: int, field: str) -> None:
    """Raise `RequestError` naming `field` when a `width` x `height` picture exceeds `MAX_IMAGE_PIXELS`."""
    if width * height > MAX_IMAGE_PIXELS:
        raise _pixel_cap_error(field, f"{width}x{height} = {width * height / 1e6:.1f} MP")


def read_image(source, field: str = "image"):
    """A keyframe as an RGB PIL image, from a path, PIL image or `(H, W, 3)` uint8 array.

    Raises `RequestError` naming `field` for a missing, unreadable, truncated or non-image file, or one of more than
    `MAX_IMAGE_PIXELS` pixels (checked from its header, before decoding).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] not in (3, 4) or source.dtype != np.uint8:
            raise RequestError(
                f"{field} array must be (height, width, 3) uint8 (got {source.shape}, {source.dtype}).", field
            )
        return Image.fromarray(source[..., :3])
    path = Path(source)
    if not path.is_file():
        raise RequestError(f"{field} file {_shown(path)} does not exist.", field)
    try:
        with _open_image(path) as image:
            check_pixels(*image.size, field)
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError:
        raise _pixel_cap_error(field, "larger than PIL opens") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        if isinstance(error, RequestError):
            raise
        raise RequestError(
            f"{field} file {_shown(path)} is not a readable image ({type(error).__name__}).", field
        ) from None


def upload_suffix(path, kind: str, field: str) -> str:
    """The suffix an uploaded file is stored under, from what its content decodes as (never the name a client
    gave): `kind` "image" (PNG, JPEG, WebP, GIF, BMP, TIFF; pixel count checked from the header), "video" (MP4/MOV,
    WebM/MKV, AVI, MPEG-TS, MPEG with a video stream) or "audio" (WAV, MP3, FLAC, OGG, AAC, M4A, MKA, or a video
    container whose soundtrack is taken). Raises `RequestError` naming `field` for content of another kind."""
    if kind == "image":
        from PIL import Image

        try:
            with _open_image(path) as image:
                found, size = image.format, image.size
        except Image.DecompressionBombError:
            raise _pixel_cap_error(field, "larger than PIL opens") from None
        except Exception:  # whatever PIL cannot identify is simply not an image
            found, size = None, (0, 0)
        if found not in IMAGE_FORMATS:
            raise RequestError(f"{field} is not a readable image (send PNG, JPEG, WebP, GIF, BMP or TIFF).", field)
        check_pixels(*size, field)
        return IMAGE_FORMATS[found]
    import av

    formats = VIDEO_FORMATS if kind == "video" else AUDIO_FORMATS
    try:
        with av.open(str(path)) as container:
            name, has_video, has_audio = (
                container.format.name,
                bool(container.streams.video),
                bool(container.streams.audio),
            )
            size = (
                (container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height)
                if has_video
                else (0, 0)
            )
    except (av.error.FFmpegError, OSError, ValueError):
        name, has_video, has_audio, size = None, False, False, (0, 0)
    if kind == "video":
        if name not in formats or not has_video:
            raise RequestError(f"{field} is not a readable video (send MP4, MOV, WebM, MKV, AVI or MPEG).", field)
        check_pixels(*size, field)
        return ".webm" if name == "matroska,webm" and _is_webm(path) else formats[name]
    if name not in formats and name not in VIDEO_FORMATS:
        raise RequestError(f"{field} is not a readable audio file (send WAV, MP3, M4A, FLAC, OGG or AAC).", field)
    if not has_audio:
        raise RequestError(f"{field} has no audio stream.", field)
    if name == "matroska,webm" and _is_webm(path):
        return ".webm"
    if has_video and name in VIDEO_FORMATS:  # a video given for its soundtrack keeps a video's suffix
        return VIDEO_FORMATS[name]
    return formats.get(name) or VIDEO_FORMATS[name]


def _is_webm(path) -> bool:
    """Matroska files declare their flavour in the EBML header's DocType, within the first bytes."""
    with open(path, "rb") as handle:
        return b"webm" in handle.read(64)


# ---------------------------------------------------------------------------------------------- reference media in

MAX_MEDIA_SECONDS = 60.0  # longest reference clip accepted; the model uses at most the first 15 s of it


def _media_error(field: str, path, what: str, error: Exception) -> RequestError:
    return RequestError(f"{field} file {_shown(path)} is not a readable {what} ({type(error).__name__}).", field)


def _open_media(source, field: str):
    import av

    path = Path(source)
    if not path.is_file():
        raise RequestError(f"{field} file {_shown(path)} does not exist.", field)
    try:
        return av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise _media_error(field, path, "media file", error) from None


def _check_length(seconds: float | None, field: str, path) -> None:
    if seconds is not None and seconds > MAX_MEDIA_SECONDS + 1e-6:
        raise RequestError(
            f"{field} file {_shown(path)} lasts {seconds:.1f} s; a reference may last at most "
            f"{MAX_MEDIA_SECONDS:g} s (the model uses at most the first 15 s).",
            field,
        )


def _container_seconds(container) -> float | None:
    import av

    return container.duration / av.time_base if container.duration else None


@dataclass(frozen=True)
class VideoFileInfo:
    """What a video file holds, before decoding it: frame rate, display size (rotation applied), soundtrack."""

    fps: float
    width: int
    height: int
    has_audio: bool
    seconds: float | None


def probe_video(source, field: str = "video") -> VideoFileInfo:
    """Open a video file and read its stream metadata. Raises `RequestError` naming `field` for a missing,
    unreadable or over-long file, or one without a video stream."""
    with _open_media(source, field) as container:
        if not container.streams.video:
            raise RequestError(f"{field} file {_shown(source)} has no video stream.", field)
        if container.format.name.startswith("image2") or container.format.name.endswith("_pipe"):
            raise RequestError(f"{field} file {_shown(source)} is a still image, not a video.", field)
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        width, height = stream.codec_context.width, stream.codec_context.height
        check_pixels(width, height, field)
        seconds = _container_seconds(container)
        has_audio = bool(container.streams.audio)
    if not fps > 0:
        raise RequestError(f"{field} file {_shown(source)} does not say its frame rate.", field)
    _check_length(seconds, field, source)
    return VideoFileInfo(fps=fps, width=width, height=height, has_audio=has_audio, seconds=seconds)


def iter_video_frames(source, field: str = "video", max_frames: int | None = None):
    """Yield a video file's frames as `(H, W, 3)` uint8 RGB, upright (the stream's display rotation undone, as
    ffmpeg shows it), at most `max_frames` of them. Raises `RequestError` naming `field` for a file that does not
    decode, has no frames, or runs past the length limit."""
    import av

    count = 0
    with _open_media(source, field) as container:
        if not container.streams.video:
            raise RequestError(f"{field} file {_shown(source)} has no video stream.", field)
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 24)
        limit = int(MAX_MEDIA_SECONDS * fps) + 2
        try:
            for frame in container.decode(stream):
                if max_frames is not None and count >= max_frames:
                    break
                count += 1
                if count > limit:
                    _check_length(count / fps, field, source)
                pixels = frame.to_ndarray(format="rgb24")
                turns = round(frame.rotation / 90.0) % 4
                yield np.ascontiguousarray(np.rot90(pixels, k=-turns)) if turns else pixels
        except av.error.FFmpegError as error:
            raise _media_error(field, source, "video", error) from None
    if count == 0:
        raise RequestError(f"{field} file {_shown(source)} has no decodable video frames.", field)


MIN_AUDIO_RATE, MAX_AUDIO_RATE = 1000, 384000  # Hz a sound may have (a file's or an in-memory waveform's)


def check_audio_rate(rate, field: str) -> int:
    """`rate` as the sample rate of a sound, or a `RequestError` naming `field`, the rate and the allowed range."""
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_AUDIO_RATE <= rate <= MAX_AUDIO_RATE:
        raise RequestError(
            f"{field} sample_rate must be an integer from {MIN_AUDIO_RATE} to {MAX_AUDIO_RATE} Hz (got {rate!r}).",
            field,
        )
    return rate


def resample_stream(waveform: np.ndarray, rate: int, new_rate: int, chunk: int = 1 << 16) -> np.ndarray:
    """`(channels, samples)` float32 audio at `rate` resampled to `new_rate` by libswresample (PyAV), fed in chunks
    of `chunk` samples: memory and time grow with the sound's length only, whatever the two rates are (a
    windowed-sinc filter built from their ratio does not: 44101 -> 32000 Hz would need 1.4 billion taps)."""
    import av

    channels = waveform.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=new_rate)
    out = []
    for start in range(0, waveform.shape[-1], chunk):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(waveform[:, start : start + chunk], np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        out += [resampled.to_ndarray() for resampled in resampler.resample(frame)]
    out += [resampled.to_ndarray() for resampled in resampler.resample(None)]
    return np.concatenate(out, axis=-1) if out else np.zeros((channels, 0), np.float32)


def read_audio(source, field: str = "audio", max_seconds: float | None = None):
    """The first audio stream of a file (audio, or the soundtrack of a video) as a `(channels, samples)` float32
    numpy waveform at the rate the file carries, and that rate. More than two channels are downmixed to stereo.
    `max_seconds` stops decoding once that much sound is in (the rest is not needed). Raises
    `RequestError` naming `field` for a file without sound, one that does not decode, or one past the length limit.
    """
    import av

    chunks, total = [], 0
    with _open_media(source, field) as container:
        if not container.streams.audio:
            raise RequestError(f"{field} file {_shown(source)} has no audio stream.", field)
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise RequestError(f"{field} file {_shown(source)} does not say its sample rate.", field)
        check_audio_rate(rate, field)
        _check_length(_container_seconds(container), field, source)
        # Planar float at the file's own rate and layout: a format conversion only (resampling is the caller's).
        layout = stream.layout if stream.codec_context.channels <= 2 else "stereo"
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
        limit = int(MAX_MEDIA_SECONDS * rate) + rate // 10
        max_samples = None if max_seconds is None else math.ceil(max_seconds * rate) + 1
        try:
            for frame in container.decode(stream):
                for converted in resampler.resample(frame):
                    chunks.append(converted.to_ndarray())
                    total += chunks[-1].shape[-1]
                if max_samples is not None and total >= max_samples:
                    break
                if total > limit:
                    _check_length(total / rate, field, source)
            else:
                chunks += [converted.to_ndarray() for converted in resampler.resample(None)]
        except av.error.FFmpegError as error:
            raise _media_error(field, source, "audio", error) from None
    if not chunks or sum(chunk.shape[-1] for chunk in chunks) == 0:
        raise RequestError(f"{field} file {_shown(source)} has no decodable audio.", field)
    return np.concatenate(chunks, axis=-1).astype(np.float32), rate


# Preview images of a finished MP4 (the OpenAI video API's `thumbnail` and `spritesheet` variants).
SPRITESHEET_COLUMNS, SPRITESHEET_ROWS = 5, 5
SPRITESHEET_TILE_WIDTH = 256  # pixels; a tile keeps the video's aspect ratio
PREVIEW_QUALITY = 90  # JPEG quality


def _sampled_frames(path, count: int) -> list[np.ndarray]:
    """`count` frames of an MP4 spread evenly over its length (first to last), `(H, W, 3)` uint8 RGB."""
    import av

    try:
        with av.open(str(path)) as container:
            total = container.streams.video[0].frames
            if total <= 0:  # a container that does not say: decode once to count
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            wanted = {round(i * (total - 1) / max(count - 1, 1)) for i in range(count)} if count > 1 else {total // 2}
            frames = [
                frame.to_ndarray(format="rgb24")
                for index, frame in enumerate(container.decode(video=0))
                if index in wanted
            ]
    except (av.error.FFmpegError, IndexError) as error:
        raise MediaError(f"the video does not decode: {error}") from None
    if not frames:
        raise MediaError("the video has no frames.")
    return frames


def _jpeg(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=PREVIEW_QUALITY)
    return buffer.getvalue()


def mp4_thumbnail(path) -> bytes:
    """A JPEG of the MP4's middle frame, at the video's own size."""
    from PIL import Image

    return _jpeg(Image.fromarray(_sampled_frames(path, 1)[0]))


def mp4_spritesheet(path, columns: int = SPRITESHEET_COLUMNS, rows: int = SPRITESHEET_ROWS) -> tuple[bytes, dict]:
    """A JPEG grid of `columns` x `rows` frames spread evenly over the MP4 (left to right, then top to bottom),
    each `SPRITESHEET_TILE_WIDTH` wide (at most the video's width) with the video's aspect ratio; and the grid's
    layout `{columns, rows, tile_width, tile_height, frames}` (`frames`: the tiles filled)."""
    from PIL import Image

    frames = _sampled_frames(path, columns * rows)
    height, width = frames[0].shape[:2]
    tile_width = min(SPRITESHEET_TILE_WIDTH, width)
    tile_height = max(1, round(height * tile_width / width))
    sheet = Image.new("RGB", (columns * tile_width, rows * tile_height))
    for index, frame in enumerate(frames):
        tile = Image.fromarray(frame).resize((tile_width, tile_height), Image.Resampling.BILINEAR)
        sheet.paste(tile, ((index % columns) * tile_width, (index // columns) * tile_height))
    layout = {
        "columns": columns,
        "rows": rows,
        "tile_width": tile_width,
        "tile_height": tile_height,
        "frames": len(frames),
    }
    return _jpeg(sheet), layout


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
