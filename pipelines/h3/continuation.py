"""Clips longer than one request (15 s): the windows a long clip is made of, and the checks on them.

A long clip is generated as overlapping windows on one frame timeline ("guide / discard / append", as vLLM-Omni's
MiniMax-H3 continuation and ComfyUI-Minimax-H3-Continuation do it). The first window is `[0, min(T, W))`; each next
one starts `overlap` frames before the previous end and runs `W` frames or to the end. Every window is sampled as a
request of its own length, with the previous window's latent tail (its last `overlap` frames, video and audio) as
clean condition rows that share the new window's first positions; the new window's own overlap is then discarded and
only its suffix appended. Window lengths, the overlap and the whole clip are all on the VAE's 17n + 5 frame grid, so
every appended piece is a whole number of 17-frame chunks (5 latent frames each).

Audio latents (40 per second, 5/3 per frame) are cut from the cumulative frame timeline: a window `[start, end)`
holds audio latents `[round(start * 5/3), round(end * 5/3))`, so per-window rounding never accumulates into drift.
Media rotary positions of a window are shifted by `start * 5/3` onto the clip's global timeline.
"""

import math
from dataclasses import dataclass

from h3gen.errors import RequestError
from h3gen.pipelines.h3 import geometry

DEFAULT_WINDOW_FRAMES = 277  # 11.5 s
DEFAULT_OVERLAP_FRAMES = 22  # 0.9 s
MIN_WINDOW_FRAMES = 124  # 17 * 7 + 5: a window is sampled as a request of its own, at least 5 s
DEFAULT_MAX_SECONDS = 60.0  # what a server (or a pipeline) accepts unless raised
MAX_SECONDS_LIMIT = 300.0  # the most a server may be raised to
ROPE_UNITS_PER_FRAME = 5.0 / 3.0  # 40 audio latents per second over 24 fps


def audio_boundary(frame: int) -> int:
    """The audio latent index at pixel frame `frame` of the clip's timeline: round(frame * 5/3)."""
    return round(frame * 5 / 3)


@dataclass(frozen=True)
class Window:
    """One window `[start, end)` in pixel frames of the clip; `overlap` frames at its head repeat the previous
    window's tail (0 for the first window)."""

    index: int
    start: int
    end: int
    overlap: int

    @property
    def num_frames(self) -> int:
        return self.end - self.start

    @property
    def num_latent_frames(self) -> int:
        return geometry.video_latent_frames(self.num_frames)

    @property
    def audio_start(self) -> int:
        return audio_boundary(self.start)

    @property
    def audio_end(self) -> int:
        return audio_boundary(self.end)

    @property
    def num_audio_latents(self) -> int:
        return self.audio_end - self.audio_start

    @property
    def overlap_latent_frames(self) -> int:
        """Video latent frames of the guide (the previous window's tail): 5m + 2 for an overlap of 17m + 5."""
        return geometry.video_latent_frames(self.overlap) if self.overlap else 0

    @property
    def overlap_audio_latents(self) -> int:
        """Audio latents per channel of the guide, on the clip's timeline."""
        return audio_boundary(self.start + self.overlap) - self.audio_start if self.overlap else 0

    @property
    def temporal_offset(self) -> float:
        """Rotary units the window's media rows are shifted by: its start on the clip's timeline."""
        return self.start * ROPE_UNITS_PER_FRAME


def _on_grid(value, name: str, field: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < geometry.LATENTS_PER_CHUNK
        or value % geometry.FRAMES_PER_CHUNK != geometry.LATENTS_PER_CHUNK
    ):
        raise RequestError(
            f"{name} must be a frame count on the 17n+5 grid (5, 22, 39, ..., 277, ...; got {value!r}).", field
        )
    return value


def check_windows(window_frames=None, overlap_frames=None) -> tuple[int, int]:
    """The (window, overlap) of a request, defaults filled in. Both on the 17n+5 grid, the window 124 to 345 frames
    (4.5 to 14.4 s, what one request makes) and the overlap shorter than the window; else `RequestError` naming the
    field and the rule."""
    window = (
        DEFAULT_WINDOW_FRAMES if window_frames is None else _on_grid(window_frames, "window_frames", "window_frames")
    )
    overlap = (
        DEFAULT_OVERLAP_FRAMES
        if overlap_frames is None
        else _on_grid(overlap_frames, "overlap_frames", "overlap_frames")
    )
    if not MIN_WINDOW_FRAMES <= window <= geometry.MAX_FRAMES:
        raise RequestError(
            f"window_frames must be from {MIN_WINDOW_FRAMES} to {geometry.MAX_FRAMES} frames on the "
            f"17n+5 grid (got {window}).",
            "window_frames",
        )
    if overlap >= window:
        raise RequestError(
            f"overlap_frames must be shorter than window_frames (got overlap {overlap} >= window {window}).",
            "overlap_frames",
        )
    return window, overlap


def check_max_seconds(max_seconds) -> float:
    """A server's (or pipeline's) length limit: 15 to 300 s."""
    if (
        isinstance(max_seconds, bool)
        or not isinstance(max_seconds, (int, float))
        or not geometry.MAX_SECONDS <= max_seconds <= MAX_SECONDS_LIMIT
    ):
        raise RequestError(
            f"max_seconds must be from {geometry.MAX_SECONDS:g} to {MAX_SECONDS_LIMIT:g} (got {max_seconds!r}).",
            "max_seconds",
        )
    return float(max_seconds)


def long_frames(seconds, num_frames, max_seconds: float) -> int | None:
    """The clip's frame count (17n + 5, snapped up) when the request is longer than one request's 15 s, else None
    (the request is a plain one and `resolve_geometry` checks it as always). Raises `RequestError` naming the field
    for a length above `max_seconds`."""
    if num_frames is not None:
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= geometry.MAX_FRAMES:
            return None
        if geometry.align_num_frames(num_frames) > geometry.align_num_frames(int(round(max_seconds * geometry.FPS))):
            raise RequestError(
                f"num_frames must last at most {max_seconds:g} s at {geometry.FPS} fps, this server's "
                f"limit (got {num_frames} frames = {num_frames / geometry.FPS:.3g} s).",
                "num_frames",
            )
        return geometry.align_num_frames(num_frames)
    if seconds is None:
        return None
    check_seconds(seconds, max_seconds)
    if seconds <= geometry.MAX_SECONDS:
        return None
    return geometry.align_num_frames(int(round(seconds * geometry.FPS)))


def check_seconds(seconds, max_seconds: float) -> float:
    """A requested length in seconds: a finite number from 5 to `max_seconds` (the limit in force: a server's
    --max-seconds, a pipeline's `max_seconds`). Every face words the refusal the same way."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or not geometry.MIN_SECONDS <= seconds <= max_seconds
    ):
        shown = f"{seconds:g}" if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else repr(seconds)
        raise RequestError(
            f"seconds must be from {geometry.MIN_SECONDS:g} to {max_seconds:g} (got {shown}).", "seconds"
        )
    return float(seconds)


def plan_windows(total_frames: int, window_frames: int, overlap_frames: int) -> list[Window]:
    """The windows of a clip of `total_frames` (17n + 5), in order."""
    end = min(total_frames, window_frames)
    windows = [Window(0, 0, end, 0)]
    while end < total_frames:
        start = end - overlap_frames
        end = min(total_frames, start + window_frames)
        windows.append(Window(len(windows), start, end, overlap_frames))
    return windows


def window_prompts(prompt: str, prompts, num_windows: int) -> list[str]:
    """One prompt per window: `prompts` (one per window, or one for all), else `prompt` for all. Raises
    `RequestError` naming `prompts` for a list of another length or an empty entry, saying how many windows the
    request has."""
    if prompts is None:
        return [prompt] * num_windows
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise RequestError("prompts must be a list of strings, one per window (or one for all).", "prompts")
    if len(prompts) not in (1, num_windows):
        raise RequestError(
            f"prompts must hold one prompt per window or one for all: this request has {num_windows} "
            f"window{'s' if num_windows != 1 else ''} (got {len(prompts)} prompts).",
            "prompts",
        )
    for index, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"prompts[{index}] must be a non-empty string.", "prompts")
    return list(prompts) * (num_windows if len(prompts) == 1 else 1)


@dataclass(frozen=True)
class ContinuationPlan:
    """How a long request is made: its windows in order and each window's prompt."""

    windows: tuple[Window, ...]
    prompts: tuple[str, ...]
    window_frames: int
    overlap_frames: int

    @property
    def num_windows(self) -> int:
        return len(self.windows)


def window_geometry(shape: geometry.Geometry, window: Window) -> geometry.Geometry:
    """A window's own geometry (the clip's canvas, the window's frames and its audio on the clip's timeline)."""
    return geometry.Geometry(
        height=shape.height,
        width=shape.width,
        num_frames=window.num_frames,
        num_latent_frames=window.num_latent_frames,
        latent_height=shape.latent_height,
        latent_width=shape.latent_width,
        num_audio_latents=window.num_audio_latents,
    )


def clip_geometry(shape: geometry.Geometry, total_frames: int) -> geometry.Geometry:
    """The whole clip's geometry on a window's canvas."""
    return geometry.Geometry(
        height=shape.height,
        width=shape.width,
        num_frames=total_frames,
        num_latent_frames=geometry.video_latent_frames(total_frames),
        latent_height=shape.latent_height,
        latent_width=shape.latent_width,
        num_audio_latents=audio_boundary(total_frames),
    )
