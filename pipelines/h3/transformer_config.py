"""What a MiniMax-H3 transformer checkpoint fixes: the architecture (`H3TransformerConfig`, read from and written
to diffusers' `config.json`), the per-row modality tags that index the AdaLN table, and the parameters kept
float32 (`KEEP_FP32_MODULES`). Plain Python (no torch), so request checks can read a config cheaply."""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Per-row modality tags. They index the AdaLN table, so the values are a checkpoint contract.
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
NUM_MODALITIES = 3

# Parameters whose dotted name contains one of these components stay float32 whatever dtype the model is loaded in
# (the checkpoint ships them float32; diffusers' `_keep_in_fp32_modules`).
KEEP_FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")


@dataclass
class H3TransformerConfig:
    """Architecture of the MiniMax-H3 transformer; defaults are the released 33 B model."""

    num_attention_heads: int = 56  # attention heads (heads * head_dim = 7168 > hidden_size)
    attention_head_dim: int = 128  # channels per head
    hidden_size: int = 5376  # width of the residual stream
    num_layers: int = 50  # main transformer blocks
    num_refiner_layers: int = 2  # plain blocks refining the projected text rows
    ffn_dim: int = 14336  # SwiGLU inner width
    in_channels: int = 24  # video latent channels
    audio_in_channels: int = 32  # audio latent channels
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w) patch packing video latents into rows
    text_dim: int = 5120  # text encoder hidden size
    freq_dim: int = 256  # sinusoidal timestep embedding width
    time_embed_hidden_dim: int = 5376  # timestep MLP inner width
    time_embed_dim: int = 2688  # timestep MLP output = AdaLN input
    rope_freq_dim: int = 16  # rotary frequencies per (t, h, w) axis; 2 * 3 * this many head channels rotate
    rope_theta: float = 10000.0  # rotary base
    norm_eps: float = 1e-5  # block norms
    qk_norm_eps: float = 1e-5  # per-head query/key norms
    final_norm_eps: float = 1e-5  # refiner output norm and norm_out

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(
                f"rope_freq_dim={self.rope_freq_dim} rotates {6 * self.rope_freq_dim} channels, more than "
                f"attention_head_dim={self.attention_head_dim}."
            )

    @property
    def video_patch_dim(self) -> int:
        """Width of one packed video row: in_channels * prod(patch_size)."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "H3TransformerConfig":
        """Build from a diffusers `config.json` dict. Keys starting with `_` (class name, versions) are metadata;
        `quantization_config` is read by the loader."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in config if not k.startswith("_") and k not in names and k != "quantization_config")
        if unknown:
            logger.warning("Ignoring unknown transformer config fields: %s", ", ".join(unknown))
        return cls(**{k: v for k, v in config.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The config as written to `config.json` (diffusers-compatible)."""
        out = dataclasses.asdict(self)
        out["patch_size"] = list(self.patch_size)
        return {"_class_name": "MiniMaxH3Transformer3DModel", "_diffusers_version": "0.42.1", **out}
