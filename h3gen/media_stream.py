"""An MP4 written piece by piece: frames and their sound arrive in chunks (a long clip, window by window) and are
encoded as they come, so no more than one chunk is ever held. The same format and checks as `media.write_mp4`
(H.264 yuv420p + AAC stereo, decoded back and compared before the file is moved into place).
"""

import os
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from h3gen.errors import RequestError
from h3gen.media import AUDIO_RATES, MediaInfo, _to_uint8_frames, check_mp4, probe_mp4

_AUDIO_CHUNK = 1024  # AAC frame size


class Mp4Stream:
    """Write an MP4 in pieces: `write(frames, audio)` any number of times, then `close()` (verify and move into
    place) or `abort()` (remove the partial file). Also a context manager that aborts on an exception.

    Args:
        path: output file; written to a hidden temporary name and moved into place by `close`.
        width, height: frame size (even).
        num_frames: the clip's length when known: the sound is cut or padded to last exactly as long (as
            `write_mp4` does); without it the sound is written as given.
        fps, sample_rate: of the frames and the `(2, N)` float audio given to `write`.
        audio_sample_rate: rate of the AAC stream, 32000 or 48000 (default: `sample_rate`).
    """

    def __init__(self, path, *, width: int, height: int, num_frames: int | None = None, fps: int = 24,
                 sample_rate: int = 32000, audio_sample_rate: int | None = None, crf: int = 18,
                 preset: str = "medium"):
        import av

        if height % 2 or width % 2:
            raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}.")
        self.out_rate = audio_sample_rate or sample_rate
        if self.out_rate not in AUDIO_RATES:
            raise RequestError(f"audio_sample_rate must be one of {AUDIO_RATES} (got {self.out_rate}).",
                               "audio_sample_rate")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        self.width, self.height, self.fps, self.sample_rate = width, height, fps, sample_rate
        self.audio_limit = None if num_frames is None else round(num_frames * sample_rate / fps)
        self.frames = 0
        self.samples = 0  # input samples encoded so far
        self._carry = np.zeros((2, 0), dtype=np.float32)  # input samples short of one AAC frame
        self.container = av.open(str(self.partial), mode="w", format="mp4", options={"movflags": "+faststart"})
        try:
            self.video = self.container.add_stream("libx264", rate=fps)
            self.video.width, self.video.height = width, height
            self.video.pix_fmt = "yuv420p"
            self.video.options = {"crf": str(crf), "preset": preset}
            self.audio = self.container.add_stream("aac", rate=self.out_rate, layout="stereo")
            self.audio.bit_rate = 192_000
            self.resampler = av.AudioResampler(format="fltp", layout="stereo", rate=self.out_rate)
        except Exception:
            self.abort()
            raise

    def __enter__(self) -> "Mp4Stream":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self.abort()

    def _encode_audio(self, audio: np.ndarray) -> None:
        import av

        for start in range(0, audio.shape[1], _AUDIO_CHUNK):
            chunk = np.ascontiguousarray(audio[:, start: start + _AUDIO_CHUNK])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate = self.sample_rate
            frame.pts = self.samples
            frame.time_base = Fraction(1, self.sample_rate)
            self.samples += chunk.shape[1]
            for resampled in self.resampler.resample(frame):
                self.container.mux(self.audio.encode(resampled))

    def write(self, frames: np.ndarray | None = None, audio: np.ndarray | None = None,
              progress: Callable[[int], None] | None = None) -> None:
        """Encode `frames` `(F, H, W, 3)` float in [0, 1] (or uint8) and stereo `audio` `(2, N)` float in [-1, 1]
        at `sample_rate`; either may be empty. `progress(frames_written)` runs after each frame."""
        import av

        if frames is not None and len(frames):
            pixels = _to_uint8_frames(frames)
            if pixels.shape[1:3] != (self.height, self.width):
                raise ValueError(f"frames are {pixels.shape[2]}x{pixels.shape[1]}, the stream {self.width}x"
                                 f"{self.height}.")
            for frame in pixels:
                self.container.mux(self.video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
                self.frames += 1
                if progress is not None:
                    progress(self.frames)
        if audio is not None and audio.shape[-1]:
            audio = np.asarray(audio, dtype=np.float32)
            if audio.ndim != 2 or audio.shape[0] != 2:
                raise ValueError(f"audio must be stereo (2, samples), got {audio.shape}.")
            audio = np.concatenate([self._carry, audio], axis=1)
            if self.audio_limit is not None:
                audio = audio[:, : max(self.audio_limit - self.samples, 0)]
            whole = audio.shape[1] // _AUDIO_CHUNK * _AUDIO_CHUNK
            self._encode_audio(audio[:, :whole])
            self._carry = np.ascontiguousarray(audio[:, whole:])

    def close(self, verify: bool = True, progress: Callable[[int, int], None] | None = None) -> MediaInfo | None:
        """Flush both encoders (padding the sound with silence to the clip's length), finish the file, decode it
        back and check it (`progress(done, total)` per frame read back), then move it into place. Returns the
        decoded file's `MediaInfo` when `verify`; raises `MediaError` (and removes the file) when it does not match."""
        try:
            if self.audio_limit is not None and self.samples + self._carry.shape[1] < self.audio_limit:
                missing = self.audio_limit - self.samples - self._carry.shape[1]
                self._carry = np.pad(self._carry, ((0, 0), (0, missing)))
            self._encode_audio(self._carry)
            self._carry = np.zeros((2, 0), dtype=np.float32)
            self.container.mux(self.video.encode())
            for resampled in self.resampler.resample(None):
                self.container.mux(self.audio.encode(resampled))
            self.container.mux(self.audio.encode())
            self.container.close()
            info = None
            if verify:
                on_frame = None if progress is None else (lambda index: progress(index, self.frames))
                info = probe_mp4(self.partial, on_frame=on_frame)
                check_mp4(info, num_frames=self.frames, width=self.width, height=self.height, fps=self.fps,
                          sample_rate=self.out_rate)
            self.partial.replace(self.path)
            return info
        except Exception:
            self.abort()
            raise

    def abort(self) -> None:
        """Stop writing and remove the partial file."""
        try:
            self.container.close()
        except Exception:  # noqa: BLE001 - the file goes either way
            pass
        self.partial.unlink(missing_ok=True)
