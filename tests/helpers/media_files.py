"""Small media files for reference tests, written with PyAV: videos with and without sound, wav / mp3 / m4a."""

import io
import struct
import wave
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np


def moving_frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """`(count, height, width, 3)` uint8 frames of a bright square drifting over a noisy background."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 80, (count, height, width, 3), dtype=np.uint8)
    for index in range(count):
        top, left = (index * 2) % max(1, height - 8), (index * 3) % max(1, width - 8)
        frames[index, top : top + 8, left : left + 8] = (230, 200, 40)
    return frames


def tone(seconds: float, rate: int, channels: int = 2, seed: int = 0) -> np.ndarray:
    """`(channels, samples)` float32: a few sines plus a little noise, within [-0.5, 0.5]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    waves = [
        0.3 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.05 * rng.standard_normal(t.shape) for c in range(channels)
    ]
    return np.stack(waves).astype(np.float32)


def write_video(path, frames: np.ndarray, fps: int, audio: np.ndarray | None = None, rate: int = 32000) -> Path:
    """H.264 (+ AAC when `audio` is given) MP4, with no check on the durations (references may be any length)."""
    import av

    path = Path(path)
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        audio_stream = container.add_stream("aac", rate=rate, layout="stereo") if audio is not None else None
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if audio_stream is not None:
            _encode_audio(container, audio_stream, audio, rate, "stereo")
    return path


def write_audio(path, audio: np.ndarray, rate: int) -> Path:
    """An audio file whose codec follows the suffix: .wav (16-bit PCM), .mp3, .m4a (AAC)."""
    import av

    path = Path(path)
    codec, fmt = {".wav": ("pcm_s16le", "wav"), ".mp3": ("libmp3lame", "mp3"), ".m4a": ("aac", "mp4")}[path.suffix]
    layout = "stereo" if audio.shape[0] == 2 else "mono"
    with av.open(str(path), mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        _encode_audio(container, stream, audio, rate, layout)
    return path


def _encode_audio(container, stream, audio: np.ndarray, rate: int, layout: str) -> None:
    import av

    resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=rate)
    chunk = stream.codec_context.frame_size or 1024
    for start in range(0, audio.shape[1], chunk):
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(audio[:, start : start + chunk]), format="fltp", layout=layout
        )
        frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
        for converted in resampler.resample(frame):
            container.mux(stream.encode(converted))
    for converted in resampler.resample(None):
        container.mux(stream.encode(converted))
    container.mux(stream.encode())


def wav_bytes(rate: int, samples: int) -> bytes:
    """A mono 16-bit WAV of `samples` samples of a tone at any `rate` (the wave module writes what it is given, odd
    or absurd rates included)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.sin(np.arange(samples) / 3.0) * 12000).astype("<i2").tobytes())
    return buffer.getvalue()


def bomb_png(path, width: int = 13_000, height: int = 13_000, pixels: bool = True):
    """A valid grayscale PNG of `width` x `height` black pixels, a few hundred KB on disk (compressed row block by
    row block, so the test never holds the picture either); `pixels=False` writes the header alone."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, parts = zlib.compressobj(9), []
    rows = bytes(width + 1) * 256  # filter byte + pixels, 256 rows at a time
    for _ in range(height // 256 if pixels else 0):
        parts.append(compressor.compress(rows))
    parts.append(compressor.compress(bytes(width + 1) * (height % 256 if pixels else 0)) + compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")
    )
    return path
