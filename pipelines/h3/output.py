"""`H3Output`: what one generated clip hands back."""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from h3gen.media import MediaInfo, write_mp4
from h3gen.pipelines.h3 import geometry


@dataclass
class H3Output:
    """A generated clip. `video` `(F, H, W, 3)` float32 in [0, 1]; `audio` `(2, samples)` float32 in [-1, 1]
    (both None for a call with `decode=False`, and for a clip over 15 s, which is only in the MP4 at `path`)."""

    video: np.ndarray | None
    audio: np.ndarray | None
    fps: int = geometry.FPS
    sample_rate: int = 32000
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    planned_prompt: str | None = None  # the planner's prompt the clip was made from (a call with plan=True)
    path: str | None = None  # the MP4 a call with `output_path` wrote (its `video` is then None)
    media: MediaInfo | None = None  # what decoding that MP4 back found
    windows: int = 1  # how many windows the clip was made of (over 15 s: more than one)
    cached_steps: list[int] = field(default_factory=list)  # forwards (0-based) the step cache skipped (quality high)
    num_forwards: int = 0  # transformer forwards of the request (num_inference_steps - 1; a long clip: all windows')
    previews: int = 0  # previews made while denoising (`preview.py`)
    preview_seconds: float = 0.0  # the time they took
    loras: list[tuple[str, float]] = field(default_factory=list)  # adapters applied (name, scale), merged ones first
    # How it was sampled: num_inference_steps (sigma points), forwards (transformer forwards), video_shift,
    # audio_shift, recipe (the few-step recipe followed, or None); see `recipes.Sampling.describe`.
    sampling: dict = field(default_factory=dict)

    @property
    def computed_steps(self) -> list[int]:
        """Forwards that ran every block."""
        cached = set(self.cached_steps)
        return [step for step in range(self.num_forwards) if step not in cached]

    @property
    def forwards(self) -> int | None:
        """Transformer forwards the clip took."""
        return self.sampling.get("forwards")

    @property
    def num_inference_steps(self) -> int | None:
        """Sigma grid points, diffusers' count (forwards + 1)."""
        return self.sampling.get("num_inference_steps")

    def save(self, path, audio_sample_rate: int | None = None, progress: Callable[[int, int], None] | None = None):
        """Write an MP4 (H.264 + AAC stereo at `audio_sample_rate`, default 32000) and verify it decodes back.
        `progress(done, total)` runs per frame written and read back (see `write_mp4`). Returns the decoded file's
        `MediaInfo`."""
        if self.video is None:
            raise ValueError(
                "this output holds no frames: it was generated with decode=False or written to output_path already."
            )
        return write_mp4(
            path,
            self.video,
            self.audio,
            fps=self.fps,
            sample_rate=self.sample_rate,
            audio_sample_rate=audio_sample_rate,
            progress=progress,
        )
