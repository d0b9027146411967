"""The K3 vision tower (MoonViT-3d) and its projector, with the checkpoint's key names.

    pixels [Np, 3, p, p]  (row-major patches of each image, images one after another; see `image_processor`)
      -> patch_embed: Conv2d(3, D, p, stride p) + learnable 2-D position table interpolated to (h, w)
                      (+ a fixed sin-cos time embedding when t > 1)
      -> encoder: pre-norm blocks  x + wo Attn(RoPE2D(wqkv norm0(x)))  and  x + fc1 act(fc0 norm1(x)),
                  attention bidirectional within one image, qkv width independent of D
      -> final_layernorm
      -> patch merger: the (2, 2) neighbourhoods grouped, frames averaged  -> [h/2 * w/2, 4, D]
    mm_projector: flatten -> Linear(4D, 4D) -> GELU (erf) -> Linear(4D, text hidden) -> RMSNorm(eps 1e-5)

Keys: `vision_tower.patch_embed.proj.weight`, `vision_tower.patch_embed.pos_emb.weight` `[H0, W0, D]`,
`vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.weight`,
`vision_tower.encoder.final_layernorm.weight`, `mm_projector.proj.{0,2}.weight`, `mm_projector.post_norm.weight`.
Facts from sglang 0.5.23 `kimi_k3_vl.py`, `kimi_vl_moonvit.py` and `configs/kimi_k3.py`.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.errors import CheckpointError
from h3gen.linear import LinearFactory, LinearSpec, dense_linear

# The 2-D rotary table of the reference covers 512 x 512 patches; larger grids are rejected as there.
ROPE_MAX_SIDE = 512


@dataclass
class K3VisionConfig:
    """`vision_config` of a K3 checkpoint; defaults are sglang's `KimiK3VisionConfig` class defaults."""

    patch_size: int = 14
    init_pos_emb_height: int = 64  # learnable position table, interpolated to each image's patch grid
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4  # frames the fixed time embedding covers
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int = 1536  # attention width; head dim = qkv_hidden_size / heads
    norm_type: str = "rmsnorm"  # "rmsnorm" (eps = the dtype's machine epsilon, as nn.RMSNorm()) or "layernorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    activation_func: str = "gelu_pytorch_tanh"  # or "gelu"
    merge_kernel_size: tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None  # None: vt_hidden_size
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168  # forced to the text model's hidden size

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @classmethod
    def from_dict(cls, data: dict, text_hidden_size: int) -> "K3VisionConfig":
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in data.items() if k in known})
        config.merge_kernel_size = tuple(int(v) for v in config.merge_kernel_size)
        config.text_hidden_size = text_hidden_size
        if config.mm_hidden_size is None:
            config.mm_hidden_size = config.vt_hidden_size
        config.validate()
        return config

    def validate(self) -> None:
        supported = dict(
            pos_emb_type=("divided_fixed",),
            merge_type=("sd2_tpool",),
            mm_projector_type=("patchmergerv2",),
            norm_type=("rmsnorm", "layernorm"),
            activation_func=("gelu_pytorch_tanh", "gelu"),
            projector_hidden_act=("gelu",),
            pos_emb_interpolation_mode=("bilinear", "bicubic", "nearest"),
        )
        for name, allowed in supported.items():
            if getattr(self, name) not in allowed:
                raise CheckpointError(
                    f"vision_config.{name} {getattr(self, name)!r} is not supported (supported: {', '.join(allowed)})."
                )
        if self.qkv_hidden_size % self.vt_num_attention_heads or self.head_dim % 4:
            raise CheckpointError(
                f"vision_config.qkv_hidden_size {self.qkv_hidden_size} must split into "
                f"{self.vt_num_attention_heads} heads of a multiple of 4 (2-D RoPE)."
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            raise CheckpointError(
                f"vision_config.mm_hidden_size {self.mm_hidden_size} must equal vt_hidden_size "
                f"{self.vt_hidden_size} (the projector reads the tower's output)."
            )


class K3VisionRMSNorm(nn.Module):
    """`nn.RMSNorm` as the reference builds it: eps None means the input dtype's machine epsilon (float32:
    1.19e-7, bfloat16: 7.8e-3). Computed in float32."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * self.weight.float()
        return out.to(x.dtype)


def _norm(config: K3VisionConfig, dim: int) -> nn.Module:
    return K3VisionRMSNorm(dim) if config.norm_type == "rmsnorm" else nn.LayerNorm(dim)


def sincos_time_embedding(dim: int, frames: int) -> torch.Tensor:
    """`[frames, dim]`: `[sin(t w_i) | cos(t w_i)]`, `w_i = 10000^(-i / (dim/2))` (MAE's 1-D table), float32."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.arange(frames, dtype=torch.float64)[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class K3VisionPositionTable(nn.Module):
    """The learnable `[H0, W0, D]` table, resized to each image's `(h, w)` patch grid (used as is when equal)."""

    def __init__(self, config: K3VisionConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(
            torch.zeros(config.init_pos_emb_height, config.init_pos_emb_width, config.vt_hidden_size)
        )

    def forward(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """-> `[sum t*h*w, D]` in the order of the patches."""
        out = []
        for t, h, w in grids:
            if t > self.config.init_pos_emb_time:
                raise ValueError(
                    f"{t} frames; the vision tower's time embedding covers {self.config.init_pos_emb_time}."
                )
            if (h, w) == tuple(self.weight.shape[:2]):
                table = self.weight.flatten(0, 1)
            else:
                table = (
                    F.interpolate(
                        self.weight.permute(2, 0, 1).unsqueeze(0),
                        size=(h, w),
                        mode=self.config.pos_emb_interpolation_mode,
                    )[0]
                    .permute(1, 2, 0)
                    .flatten(0, 1)
                )
            if t > 1:
                time = sincos_time_embedding(table.shape[-1], t).to(table)
                table = (table[None] + time[:, None]).flatten(0, 1)
            out.append(table)
        return torch.cat(out)


class K3VisionPatchEmbed(nn.Module):
    def __init__(self, config: K3VisionConfig):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias)
        self.pos_emb = K3VisionPositionTable(config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """`[Np, 3, p, p]` -> `[Np, D]` (a conv of stride p over one patch is one matrix product)."""
        x = F.linear(pixels.flatten(1), self.proj.weight.flatten(1), self.proj.bias)
        return x + self.pos_emb(grids).to(x.dtype)


def rope_2d(grids: list[tuple[int, int, int]], head_dim: int, device, theta: float = 10000.0) -> torch.Tensor:
    """Complex rotations `[sum t*h*w, head_dim/2]` for the 2-D RoPE: pair 2i turns by `x * f_i`, pair 2i+1 by
    `y * f_i`, `f_i = theta^(-4i / head_dim)`, x the patch column and y its row (repeated over frames). Angles in
    float32, as the reference's precomputed table."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    out = []
    for t, h, w in grids:
        if not (1 <= h <= ROPE_MAX_SIDE and 1 <= w <= ROPE_MAX_SIDE):
            raise ValueError(f"a {h}x{w} patch grid exceeds the vision RoPE's {ROPE_MAX_SIDE}x{ROPE_MAX_SIDE}.")
        ys, xs = torch.meshgrid(
            torch.arange(h, device=device).float(), torch.arange(w, device=device).float(), indexing="ij"
        )
        x_angles = xs.reshape(-1, 1) * freqs
        y_angles = ys.reshape(-1, 1) * freqs
        angles = torch.stack([x_angles, y_angles], dim=-1).reshape(h * w, head_dim // 2)
        out.append(torch.polar(torch.ones_like(angles), angles).repeat(t, 1))
    return torch.cat(out)


def apply_rope_2d(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """`x` `[N, heads, head_dim]`, adjacent channels as complex pairs, rotated in float32, cast back."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotations[:, None]).flatten(-2).to(x.dtype)


class K3VisionMLP(nn.Module):
    def __init__(self, config: K3VisionConfig, linear: LinearFactory):
        super().__init__()
        d, i, bias = config.vt_hidden_size, config.vt_intermediate_size, config.linear_bias
        self.fc0 = linear(LinearSpec(d, i, bias, "replicated", "vision.mlp"))
        self.fc1 = linear(LinearSpec(i, d, bias, "replicated", "vision.mlp"))
        self.approximate = "tanh" if config.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class K3VisionBlock(nn.Module):
    def __init__(self, config: K3VisionConfig, linear: LinearFactory):
        super().__init__()
        d, width = config.vt_hidden_size, config.qkv_hidden_size
        self.num_heads, self.head_dim = config.vt_num_attention_heads, config.head_dim
        self.norm0 = _norm(config, d)
        self.norm1 = _norm(config, d)
        self.wqkv = linear(LinearSpec(d, 3 * width, config.attn_bias, "replicated", "vision.qkv"))
        self.wo = linear(LinearSpec(width, d, config.attn_bias, "replicated", "vision.out"))
        self.mlp = K3VisionMLP(config, linear)

    def attention(self, x: torch.Tensor, rotations: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """Bidirectional attention inside each `[start, end)` segment (one image)."""
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, rotations), apply_rope_2d(k, rotations)
        out = []
        for start, end in bounds:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            )
            out.append(o.transpose(0, 1))
        return self.wo(torch.cat(out).flatten(1))

    def forward(self, x, rotations, bounds):
        x = x + self.attention(self.norm0(x), rotations, bounds)
        return x + self.mlp(self.norm1(x))


class K3VisionEncoder(nn.Module):
    def __init__(self, config: K3VisionConfig, linear: LinearFactory):
        super().__init__()
        self.blocks = nn.ModuleList(K3VisionBlock(config, linear) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = _norm(config, config.vt_hidden_size)


class K3VisionTower(nn.Module):
    """Pixels of one or more images -> per image its merged patch groups `[h/2 * w/2, 4, D]`."""

    def __init__(self, config: K3VisionConfig, linear: LinearFactory = dense_linear):
        super().__init__()
        self.config = config
        self.patch_embed = K3VisionPatchEmbed(config)
        self.encoder = K3VisionEncoder(config, linear)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> list[torch.Tensor]:
        """`pixel_values` `[Np, 3, p, p]`; `grid_thws` `[n, 3]` (frames, patch rows, patch columns per image,
        `Np = sum t*h*w`)."""
        grids = check_grids(grid_thws, pixel_values, self.config)
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype), grids)
        rotations = rope_2d(grids, self.config.head_dim, x.device)
        ends = torch.tensor([t * h * w for t, h, w in grids]).cumsum(0).tolist()
        bounds = list(zip([0] + ends[:-1], ends, strict=True))
        for block in self.encoder.blocks:
            x = block(x, rotations, bounds)
        x = self.encoder.final_layernorm(x)
        return merge_patches(x, grids, self.config.merge_kernel_size)


def check_grids(grid_thws, pixel_values: torch.Tensor, config: K3VisionConfig) -> list[tuple[int, int, int]]:
    grids = [tuple(int(v) for v in row) for row in (grid_thws.tolist() if torch.is_tensor(grid_thws) else grid_thws)]
    kh, kw = config.merge_kernel_size
    p = config.patch_size
    for t, h, w in grids:
        if t < 1 or h < kh or w < kw or h % kh or w % kw:
            raise ValueError(
                f"grid (t={t}, h={h}, w={w}) must have t >= 1 and h, w positive multiples of the merge "
                f"kernel {kh}x{kw}."
            )
    expected = sum(t * h * w for t, h, w in grids)
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p) or pixel_values.shape[0] != expected:
        raise ValueError(
            f"pixel_values must be [{expected}, 3, {p}, {p}] for grids {grids} (got {list(pixel_values.shape)})."
        )
    return grids


def merge_patches(x: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]) -> list[torch.Tensor]:
    """`[sum t*h*w, D]` -> per image `[(h/kh)(w/kw), kh*kw, D]`: each kh x kw neighbourhood grouped (row-major
    within it), groups row-major, frames averaged."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        seq = x[start : start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
        seq = seq[0] if t == 1 else seq.mean(0)
        out.append(seq.reshape((h // kh) * (w // kw), kh * kw, -1))
        start += t * h * w
    return out


class K3MultiModalProjector(nn.Module):
    """PatchMergerMLPV2: merged patches `[N, kh*kw, D]` -> `[N, text hidden]`; no pre-norm, a post RMSNorm."""

    def __init__(self, config: K3VisionConfig, linear: LinearFactory = dense_linear):
        super().__init__()
        width = config.mm_hidden_size * math.prod(config.merge_kernel_size)
        self.proj = nn.Sequential(
            linear(LinearSpec(width, width, False, "replicated", "vision.projector")),
            nn.GELU(),
            linear(LinearSpec(width, config.text_hidden_size, False, "replicated", "vision.projector")),
        )
        self.post_norm = K3VisionRMSNorm(config.text_hidden_size, config.projector_ln_eps)

    def forward(self, features: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(f.shape[0], -1) for f in features])
        return self.post_norm(self.proj(features.reshape(features.shape[0], -1)))
