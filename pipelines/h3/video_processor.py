"""Qwen3-VL's video preprocessing (transformers' `Qwen3VLVideoProcessor`), without torchvision.

transformers implements it on torchvision's tensor ops, which the CPU build of torch cannot always have next to it.
The whole recipe is small: resize every frame to the `smart_resize` grid (bicubic, antialiased, on uint8 — what
torchvision's `resize` runs on a CPU tensor), rescale and normalize in one fused step, pad the frames to a whole
temporal patch by repeating the last one, and cut `(t, h, w)` patches in the merge-window order the vision tower
reads. Same inputs, same `pixel_values_videos` and `video_grid_thw`.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Qwen3VLVideoProcessor's class defaults, used where a config leaves a value out.
DEFAULT_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}


@dataclass
class QwenVideoProcessor:
    """Turns `(F, H, W, 3)` uint8 videos (frames already sampled) into the vision tower's video inputs."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    min_pixels: int = DEFAULT_SIZE["shortest_edge"]
    max_pixels: int = DEFAULT_SIZE["longest_edge"]
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_folder(cls, folder: Path) -> "QwenVideoProcessor":
        """From `processor/video_preprocessor_config.json`, else from the image processor's
        `preprocessor_config.json` (older layouts keep one config for both)."""
        folder = Path(folder)
        path = folder / "video_preprocessor_config.json"
        if not path.exists():
            path = folder / "preprocessor_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        size = {**DEFAULT_SIZE, **(config.get("size") or {})}
        fields = {
            name: config[name]
            for name in (
                "patch_size",
                "temporal_patch_size",
                "merge_size",
                "rescale_factor",
                "cap_pixels_per_frame",
                "max_video_tokens",
            )
            if config.get(name) is not None
        }
        for name in ("image_mean", "image_std"):
            if config.get(name) is not None:
                fields[name] = tuple(config[name])
        return cls(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"], **fields)

    def grid_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) a video is resized to: transformers' `smart_resize` on the merge-window grid."""
        # transformers is heavy (seconds to import): imported where it is used
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(
                min(self.max_video_tokens * factor * factor, self.max_pixels // num_frames), int(self.min_pixels * 1.05)
            )
            max_pixels = per_frame * num_frames
        return smart_resize(
            num_frames=num_frames,
            height=height,
            width=width,
            temporal_factor=self.temporal_patch_size,
            factor=factor,
            min_pixels=self.min_pixels,
            max_pixels=max_pixels,
        )

    def __call__(self, videos: list[np.ndarray]) -> dict[str, torch.Tensor]:
        """`videos`: `(F, H, W, 3)` uint8 each. Returns `pixel_values_videos` `(sum of patches, 3 * t * p * p)`
        float32 and `video_grid_thw` `(len(videos), 3)` long."""
        patches, grids = [], []
        for video in videos:
            pixels = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2)  # (F, 3, H, W) uint8
            num_frames, channels, height, width = pixels.shape
            size = self.grid_size(num_frames, height, width)
            if size != (height, width):
                pixels = torch.nn.functional.interpolate(
                    pixels.contiguous(), size=size, mode="bicubic", align_corners=False, antialias=True
                )
            # Rescale folded into the normalization: (x - mean / r) / (std / r), in float32.
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            pixels = (pixels.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
            if pad := -num_frames % self.temporal_patch_size:
                pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
            t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
            grid_t, grid_h, grid_w = pixels.shape[0] // t, size[0] // p, size[1] // p
            cut = pixels.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
            cut = cut.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(cut.reshape(grid_t * grid_h * grid_w, channels * t * p * p))
            grids.append([grid_t, grid_h, grid_w])
        return {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
