"""Reference media in: a video file's metadata and upright RGB frames, and a sound file's (or a video's soundtrack's)
waveform, each read with PyAV under the length limit `MAX_MEDIA_SECONDS`; the sample rates a sound may have."""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h3gen.errors import RequestError
from h3gen.media.errors import shown_name
from h3gen.media.uploads import check_pixels

MAX_MEDIA_SECONDS = 60.0  # longest reference clip accepted; the model uses at most the first 15 s of it


def _media_error(field: str, path, what: str, error: Exception) -> RequestError:
    return RequestError(f"{field} file {shown_name(path)} is not a readable {what} ({type(error).__name__}).", field)


def _open_media(source, field: str):
    import av

    path = Path(source)
    if not path.is_file():
        raise RequestError(f"{field} file {shown_name(path)} does not exist.", field)
    try:
        return av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise _media_error(field, path, "media file", error) from None


def _check_length(seconds: float | None, field: str, path) -> None:
    if seconds is not None and seconds > MAX_MEDIA_SECONDS + 1e-6:
        raise RequestError(
            f"{field} file {shown_name(path)} lasts {seconds:.1f} s; a reference may last at most "
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
            raise RequestError(f"{field} file {shown_name(source)} has no video stream.", field)
        if container.format.name.startswith("image2") or container.format.name.endswith("_pipe"):
            raise RequestError(f"{field} file {shown_name(source)} is a still image, not a video.", field)
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        width, height = stream.codec_context.width, stream.codec_context.height
        check_pixels(width, height, field)
        seconds = _container_seconds(container)
        has_audio = bool(container.streams.audio)
    if not fps > 0:
        raise RequestError(f"{field} file {shown_name(source)} does not say its frame rate.", field)
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
            raise RequestError(f"{field} file {shown_name(source)} has no video stream.", field)
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
        raise RequestError(f"{field} file {shown_name(source)} has no decodable video frames.", field)


MIN_AUDIO_RATE, MAX_AUDIO_RATE = 1000, 384000  # Hz a sound may have (a file's or an in-memory waveform's)


def check_audio_rate(rate, field: str) -> int:
    """`rate` as the sample rate of a sound, or a `RequestError` naming `field`, the rate and the allowed range."""
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_AUDIO_RATE <= rate <= MAX_AUDIO_RATE:
        raise RequestError(
            f"{field} sample_rate must be an integer from {MIN_AUDIO_RATE} to {MAX_AUDIO_RATE} Hz (got {rate!r}).",
            field,
        )
    return rate


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
            raise RequestError(f"{field} file {shown_name(source)} has no audio stream.", field)
        stream = container.streams.audio[0]
        rate = int(stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise RequestError(f"{field} file {shown_name(source)} does not say its sample rate.", field)
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
        raise RequestError(f"{field} file {shown_name(source)} has no decodable audio.", field)
    return np.concatenate(chunks, axis=-1).astype(np.float32), rate
