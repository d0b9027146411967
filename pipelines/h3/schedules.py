"""MiniMax-H3's two rectified-flow schedules (video shift 12, audio shift 3) and their Euler step (docs/model.md,
"Schedules").

Convention: t = 1 - sigma, t = 1 is clean; the model predicts a data-ward velocity, x0 = x_t + sigma * v. Same
arithmetic as diffusers' `MiniMaxH3Scheduler`, so the trajectories are identical.

Two step counts meet here. diffusers' `num_inference_steps=N` counts sigma grid points, the terminal 0 included, so
N points drive N - 1 transformer forwards (`make`); SGLang and vLLM-Omni count forwards (`from_forwards`).
Distilled few-step adapters pin their own base positions instead of a uniform grid (`from_base`).
"""

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0


@dataclass
class FlowSchedule:
    """A shifted sigma grid. `sigmas` `(N,)` float32 ends at 0; `timesteps = 1 - sigmas[:-1]`, one per forward."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @classmethod
    def make(cls, num_inference_steps: int, shift: float) -> "FlowSchedule":
        """`num_inference_steps` grid points of linspace(1, 0) pushed through sigma' = s*sigma / (1 + (s-1)*sigma),
        consecutive duplicates collapsed: N grid points, N - 1 forwards. Built on the CPU in float32."""
        if num_inference_steps < 2:
            raise ValueError(f"num_inference_steps must be at least 2 (got {num_inference_steps}).")
        if not shift > 0:
            raise ValueError(f"shift must be positive (got {shift}).")
        base = torch.linspace(1.0, 0.0, int(num_inference_steps), dtype=torch.float32)
        sigmas = torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))
        return cls(sigmas=sigmas, timesteps=1.0 - sigmas[:-1])

    @classmethod
    def from_forwards(cls, forwards: int, shift: float) -> "FlowSchedule":
        """A uniform grid of `forwards` transformer forwards: `make(forwards + 1, shift)`, the grid SGLang and
        vLLM-Omni build for `num_inference_steps=forwards`."""
        if forwards < 1:
            raise ValueError(f"forwards must be at least 1 (got {forwards}).")
        return cls.make(int(forwards) + 1, shift)

    @classmethod
    def from_base(cls, base_sigmas, shift: float) -> "FlowSchedule":
        """Explicit base positions (before the shift, e.g. a distilled adapter's `base_schedule` `[1.0, 0.7, 0.4,
        0.15, 0.0]`) pushed through the same shift as `make`: len(base) points, len(base) - 1 forwards. The base
        must start at 1 or below, end at 0 and decrease strictly; the shifted grid is what diffusers'
        `set_timesteps(sigmas=...)` takes verbatim."""
        base = torch.as_tensor(list(base_sigmas), dtype=torch.float32).flatten()
        check_base_schedule(base.tolist())
        if not shift > 0:
            raise ValueError(f"shift must be positive (got {shift}).")
        sigmas = shift * base / (1 + (shift - 1) * base)
        if not bool((sigmas[1:] < sigmas[:-1]).all()):
            raise ValueError(f"base schedule {base.tolist()} collapses under shift {shift:g} in float32.")
        return cls(sigmas=sigmas, timesteps=1.0 - sigmas[:-1])

    def __len__(self) -> int:
        return self.timesteps.numel()

    def step(self, index: int, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Euler step `index` (eta = 0): x0 = x_t + (1 - t) * v; x_next = r * x_t + (1 - r) * x0, r = sigma_next /
        sigma, in float32 for half-precision samples. Returns `sample`'s shape and dtype."""
        t = self.timesteps[index].to(device=sample.device, dtype=sample.dtype)
        denoised = sample + (1 - t) * velocity
        dtype = torch.float32 if sample.dtype in (torch.float16, torch.bfloat16) else sample.dtype
        sigma = self.sigmas[index].to(device=sample.device, dtype=dtype)
        sigma_next = self.sigmas[index + 1].to(device=sample.device, dtype=dtype)
        ratio = sigma_next / sigma
        return (ratio * sample.to(dtype) + (1.0 - ratio) * denoised.to(dtype)).to(sample.dtype)


def check_base_schedule(base: list[float]) -> None:
    """Raise `ValueError` unless `base` holds at least two finite positions from at most 1.0 (FastH3's DMD grid
    starts at 0.999) down to 0.0, strictly decreasing."""
    if len(base) < 2 or any(not math.isfinite(value) for value in base):
        raise ValueError(f"a base schedule needs at least two finite positions (got {base}).")
    if not 0.0 < base[0] <= 1.0 or base[-1] != 0.0 or any(a <= b for a, b in itertools.pairwise(base)):
        raise ValueError(f"a base schedule must run from at most 1.0 down to 0.0, strictly decreasing (got {base}).")


def noise_to(sample: torch.Tensor, t: float, noise: torch.Tensor) -> torch.Tensor:
    """Forward process at level `t` (1 = clean): t * sample + (1 - t) * noise, with `t` in `sample`'s dtype."""
    level = torch.tensor(t, dtype=sample.dtype, device=sample.device)
    return level * sample + (1.0 - level) * noise


def read_shift(folder: Path, default: float) -> float:
    """The `shift` of a `scheduler_config.json` folder, or `default` when the folder has none."""
    path = Path(folder) / "scheduler_config.json"
    if not path.exists():
        return default
    return float(json.loads(path.read_text()).get("shift", default))


def write_scheduler_config(folder: Path, shift: float) -> None:
    """Write a diffusers `MiniMaxH3Scheduler` config with this shift."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"_class_name": "MiniMaxH3Scheduler", "_diffusers_version": "0.42.1", "shift": shift}
    (folder / "scheduler_config.json").write_text(json.dumps(config, indent=2))
