"""MiniMax-H3's two rectified-flow schedules (video shift 12, audio shift 3) and their Euler step (docs/model.md,
"Schedules").

Convention: t = 1 - sigma, t = 1 is clean; the model predicts a data-ward velocity, x0 = x_t + sigma * v. Same
arithmetic as diffusers' `MiniMaxH3Scheduler`, so the trajectories are identical.
"""

import json
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
