"""K3 image preprocessing: NaViT resize, padding to the merge grid, normalisation and patchify.

For an image of W x H pixels (`media_proc_cfg`: patch size p, merge size m, `in_patch_limit`,
`patch_limit_on_one_side` L):

    scale = min(1, sqrt(in_patch_limit / (max(1, W // p) * max(1, H // p))), L p / W, L p / H)
    W' = min(max(1, int(W scale)), L p)          H' likewise          (never upscaled)
    bicubic resize to W' x H' (PIL, uint8), RGBA composited onto `transparent_bg_config`'s background
    zero-pad right / bottom to multiples of m p  ->  Wp x Hp
    x -> x / (255 std) - mean / std              (pad pixels become -mean / std)
    patches [Hp/p * Wp/p, 3, p, p] row-major, grid (1, Hp/p, Wp/p), (Hp / (m p)) * (Wp / (m p)) image tokens

Facts from sglang 0.5.23 `processors/kimi_k25.py` (`navit_resize_config`), `kimi_k3_image_processing.py`
(`fill_transparent_bg`, `normalization_tensors`) and `kernels/ops/mm/process/image.py` (pad, normalise, patchify).
sglang's CPU path runs the checkpoint's own processor, whose resize is `PIL.Image.resize(..., BICUBIC)` (its GPU
path approximates that with an antialiased `F.interpolate`); this module resizes with PIL.
"""

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from h3gen.errors import CheckpointError

BACKGROUNDS = ("black", "white", "gray", "chessboard")


@dataclass
class K3MediaConfig:
    """The checkpoint's `media_proc_cfg`. Defaults: K2.5's processor (K3's own values come with the checkpoint)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384  # most patches per image
    patch_limit_on_one_side: int = 512  # most patches along either side
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    fixed_output_tokens: int | None = None  # a fixed token count reported per image (None: from the grid)
    transparent_bg_config: dict | None = None  # None: alpha dropped; else {"pattern": black|white|gray|chessboard}
    max_images: int = 64  # per request; h3gen's limit, not the checkpoint's

    @classmethod
    def from_dict(cls, data: dict) -> "K3MediaConfig":
        data = data.get("media_proc_cfg", data)
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in data.items() if k in known})
        if isinstance(config.merge_kernel_size, (list, tuple)):
            if len(set(config.merge_kernel_size)) != 1:
                raise CheckpointError(f"merge_kernel_size {config.merge_kernel_size} must be square.")
            config.merge_kernel_size = config.merge_kernel_size[0]
        config.image_mean, config.image_std = tuple(config.image_mean), tuple(config.image_std)
        config.validate()
        return config

    @classmethod
    def from_folder(cls, folder) -> "K3MediaConfig":
        """`preprocessor_config.json` of a checkpoint folder (its `media_proc_cfg`, or the fields at top level)."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.exists():
            raise CheckpointError(f"{path} is missing; the K3 image processor needs its media_proc_cfg.")
        return cls.from_dict(json.loads(path.read_text()))

    def validate(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "max_images"):
            if int(getattr(self, name)) < 1:
                raise CheckpointError(f"media_proc_cfg.{name} must be >= 1 (got {getattr(self, name)}).")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise CheckpointError("media_proc_cfg image_mean / image_std need 3 values, std > 0.")
        pattern = (self.transparent_bg_config or {}).get("pattern", "black")
        if pattern not in BACKGROUNDS:
            raise CheckpointError(f"transparent_bg_config pattern {pattern!r} is not one of {', '.join(BACKGROUNDS)}.")


@dataclass(frozen=True)
class ImageResize:
    """Where one image goes: resized to `new_width` x `new_height`, padded by `pad_width` / `pad_height`."""

    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    num_tokens: int

    @property
    def padded(self) -> tuple[int, int]:
        """(width, height) after padding."""
        return self.new_width + self.pad_width, self.new_height + self.pad_height


def navit_resize(width: int, height: int, config: K3MediaConfig) -> ImageResize:
    """The resize rule (pure arithmetic on the original size)."""
    p, limit_side = config.patch_size, config.patch_limit_on_one_side
    scale = min(
        1.0,
        math.sqrt(config.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
        limit_side * p / width,
        limit_side * p / height,
    )
    new_w = min(max(1, int(width * scale)), limit_side * p)
    new_h = min(max(1, int(height * scale)), limit_side * p)
    factor = config.merge_kernel_size * p
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    tokens = config.fixed_output_tokens
    if tokens is None:
        tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return ImageResize(new_w, new_h, pad_w, pad_h, tokens)


@dataclass
class ProcessedImages:
    """`pixel_values` `[sum h*w, 3, p, p]` float32 (all images' patches, in order), `grid_thws` `[n, 3]` int64,
    `num_tokens` (the `<|media_pad|>` count per image) and `image_sizes` (original (width, height))."""

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    num_tokens: list[int] = field(default_factory=list)
    image_sizes: list[tuple[int, int]] = field(default_factory=list)


def to_pil(image, index: int = 0) -> Image.Image:
    """A PIL image in mode RGB or RGBA from PIL / uint8 numpy (HW, HWC) / uint8 torch (HW, CHW with C in 1, 3, 4,
    else HWC)."""
    where = f"image {index}"
    if isinstance(image, Image.Image):
        if image.width < 1 or image.height < 1:
            raise ValueError(f"{where} is empty ({image.width}x{image.height}).")
        has_alpha = image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)
        return image.convert("RGBA" if has_alpha else "RGB")
    if isinstance(image, torch.Tensor):
        tensor = image.detach().cpu()
        if tensor.ndim == 3 and tensor.shape[0] in (1, 3, 4):  # tensors are CHW (as sglang reads them)
            tensor = tensor.permute(1, 2, 0)
        array = tensor.numpy()
    elif isinstance(image, np.ndarray):
        array = image
    else:
        raise TypeError(f"{where} is a {type(image).__name__}; expected a PIL image, a numpy array or a torch tensor.")
    if array.dtype != np.uint8:
        raise TypeError(f"{where} has dtype {array.dtype}; arrays and tensors must hold uint8 pixels 0..255.")
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"{where} has shape {list(array.shape)}; expected HxW, HxWxC or (tensors) CxHxW with C in 1, 3, 4."
        )
    if array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"{where} is empty ({array.shape[1]}x{array.shape[0]}).")
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    return Image.fromarray(np.ascontiguousarray(array), mode="RGBA" if array.shape[-1] == 4 else "RGB")


def fill_transparent_background(rgba: np.ndarray, config: dict | None) -> np.ndarray:
    """`[H, W, 4]` float -> `[H, W, 3]`: alpha dropped (no config) or composited onto the configured background,
    `floor(clamp(a rgb + (1 - a) bg, 0, 255))` with `a = alpha / 255`."""
    rgb = rgba[..., :3]
    if config is None:
        return rgb
    height, width = rgba.shape[:2]
    pattern = config.get("pattern", "black")
    if pattern == "chessboard":
        square = config.get("chessboard_square_size", 16)
        white = float(config.get("chessboard_white_value", 255))
        gray = float(config.get("chessboard_gray_value", 200))
        parity = (np.arange(height)[:, None] // square + np.arange(width)[None] // square) % 2
        on_gray = 1 if config.get("chessboard_square_on_top_left", True) else 0
        background = np.where(parity == on_gray, gray, white)[..., None]
    else:
        background = np.full((height, width, 1), {"white": 255.0, "black": 0.0, "gray": 128.0}[pattern])
    alpha = np.clip(rgba[..., 3:4] / 255.0, 0.0, 1.0)
    return np.floor(np.clip(alpha * rgb + (1.0 - alpha) * background, 0.0, 255.0))


class K3ImageProcessor:
    def __init__(self, config: K3MediaConfig | None = None):
        self.config = config or K3MediaConfig()

    @classmethod
    def from_folder(cls, folder) -> "K3ImageProcessor":
        return cls(K3MediaConfig.from_folder(folder))

    def resize_for(self, width: int, height: int) -> ImageResize:
        return navit_resize(width, height, self.config)

    def __call__(self, images) -> ProcessedImages:
        return self.preprocess(images)

    def preprocess(self, images) -> ProcessedImages:
        """One image or a list of them (PIL, uint8 numpy HWC, uint8 torch CHW/HWC) -> `ProcessedImages`."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("no images given.")
        if len(images) > self.config.max_images:
            raise ValueError(f"{len(images)} images; at most {self.config.max_images} per request.")
        c, p = self.config, self.config.patch_size
        patches, grids, tokens, sizes = [], [], [], []
        for index, image in enumerate(images):
            pil = to_pil(image, index)
            sizes.append(pil.size)
            resize = self.resize_for(pil.width, pil.height)
            if (pil.width, pil.height) != (resize.new_width, resize.new_height):
                pil = pil.resize((resize.new_width, resize.new_height), Image.Resampling.BICUBIC)
            pixels = np.asarray(pil, dtype=np.float32)
            if pixels.shape[-1] == 4:
                pixels = fill_transparent_background(pixels, c.transparent_bg_config)
            x = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)).permute(2, 0, 1)
            x = torch.nn.functional.pad(x, (0, resize.pad_width, 0, resize.pad_height), value=0.0)
            scale = torch.tensor([1.0 / (255.0 * s) for s in c.image_std]).view(3, 1, 1)
            bias = torch.tensor([-m / s for m, s in zip(c.image_mean, c.image_std, strict=True)]).view(3, 1, 1)
            x = torch.addcmul(bias, x, scale)
            h, w = x.shape[1] // p, x.shape[2] // p
            patches.append(x.view(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p))
            grids.append((1, h, w))
            tokens.append(resize.num_tokens)
        return ProcessedImages(torch.cat(patches), torch.tensor(grids, dtype=torch.int64), tokens, sizes)
