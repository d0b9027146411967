"""The MiniMax-H3 transformer: a single-stream DiT over one packed sequence.

One packed 1-D sequence holds text rows (Qwen3-VL hidden states), conditioning rows, stereo audio latent rows and
video latent rows under full bidirectional self-attention. Modalities differ only in their input projections, a
per-row AdaLN table indexed by `(timestep, modality)` and two output heads (docs/model.md, "Transformer").

Same config fields, state-dict keys, forward arguments and outputs as diffusers 0.42.1's
`MiniMaxH3Transformer3DModel`, and the same op order, so the `exact` tier reproduces it. What makes it fast or
distributed is reached only through three seams:
  - every linear comes from a `LinearFactory` (`h3gen.linear`), so tensor-parallel and quantized linears slot in;
  - attention goes through `AttentionCore`, a parameter-free module that Ulysses can replace;
  - `H3TransformerBlock` is self-contained (its AdaLN projection included), so offload can move it as a unit.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.attention import attention
from h3gen.linear import LinearFactory, LinearSpec, dense_linear
from h3gen.loading import save_component
from h3gen.pipelines.h3.loader import load_transformer

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


@dataclass
class H3TransformerOutput:
    """Velocities for every video row (`sample`, `(B, N_video, video_patch_dim)`) and audio row (`audio_sample`,
    `(B, N_audio, audio_in_channels)`), in the order of `video_indices` / `audio_indices`. Conditioning rows are
    included; masking them is the caller's job."""

    sample: torch.Tensor
    audio_sample: torch.Tensor

    def __iter__(self):
        return iter((self.sample, self.audio_sample))


@dataclass
class AdaLNTables:
    """Every block's AdaLN table and `norm_out`'s for all steps of one request, computed once before denoising.

    The sigma schedule is fixed per request, so each block's 260 M-parameter AdaLN projection is run once over all
    steps' distinct timesteps (a few hundred rows) instead of once per step: its weights are read once per request
    and the block forward does no AdaLN GEMM. Step `i` owns timestep rows `offsets[i] : offsets[i] + counts[i]`.
    Batching changes the GEMM's shape, so results may differ from per-step projection in the last bits: the
    `exact` tier does not use it.
    """

    blocks: list[torch.Tensor]  # per block: (sum K * 3, 6 * hidden)
    final: torch.Tensor  # (sum K, 2 * hidden)
    offsets: list[int]
    counts: list[int]

    def for_step(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Views of step `step`'s tables: per block `(K * 3, 6 * hidden)`, and `(K, 2 * hidden)`."""
        start, count = self.offsets[step], self.counts[step]
        return [t[start * 3 : (start + count) * 3] for t in self.blocks], self.final[start : start + count]


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: its `compute_dtype` attribute if it has one (quantized linears), else the
    dtype of its first floating-point parameter."""
    dtype = getattr(module, "compute_dtype", None)
    if dtype is not None:
        return dtype
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def timestep_sinusoids(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of unscaled timesteps, cosines first (diffusers `Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0)`).

    Args:
        timesteps: `(K,)` any float dtype.
    Returns:
        `(K, dim)` float32.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    angles = timesteps[:, None].float() * torch.exp(exponent / half)[None, :]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading `cos.shape[-1]` channels of each head; the rest pass through.

    Args:
        x: `(B, S, heads, head_dim)`.
        cos, sin: `(S, rotary_dim)` float32; cast to `x.dtype` first, as the reference does.
    Returns:
        `(B, S, heads, head_dim)`, contiguous, in `x.dtype`.
    """
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1).contiguous()


class H3RotaryPosEmbed(nn.Module):
    """3-axis RoPE angles: one `inv_freq` of `rope_freq_dim` frequencies shared by t, h and w; the three angle
    blocks are concatenated and then duplicated for the rotate-half convention."""

    def __init__(self, rope_freq_dim: int, rope_theta: float):
        super().__init__()
        # Computed, never loaded: built on the CPU explicitly so it is real even when the model is built on meta.
        exponents = torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32, device="cpu") / (2 * rope_freq_dim)
        self.register_buffer("inv_freq", 1.0 / (rope_theta**exponents), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids` `(S, 3)` (float64 from packing) -> `cos`, `sin` each `(S, 6 * rope_freq_dim)` float32."""
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.view(1, 1, -1)
        freqs = torch.cat(freqs.unbind(dim=1), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()


class H3TimestepEmbedding(nn.Module):
    """Timestep MLP `linear_1 -> SiLU -> linear_2` (a float32 island)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, make_linear: LinearFactory):
        super().__init__()
        self.linear_1 = make_linear(LinearSpec(in_dim, hidden_dim, True, kind="time", fp32=True))
        self.linear_2 = make_linear(LinearSpec(hidden_dim, out_dim, True, kind="time", fp32=True))

    def forward(self, sinusoids: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(sinusoids)))


class AttentionCore(nn.Module):
    """Parameter-free attention over `(B, S, heads, head_dim)` q/k/v. Sequence parallel replaces this module with
    one that exchanges heads for rows around the same call."""

    def __init__(self, backend: str | None = None):
        super().__init__()
        self.backend = backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return attention(query, key, value, backend=self.backend)


class H3Attention(nn.Module):
    """Bias-free q/k/v, per-head RMSNorm on q and k, optional RoPE, full attention, output projection.

    Heads are inferred from the projection width, so a column-sharded `to_q` simply yields fewer local heads.
    """

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float, make_linear: LinearFactory):
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = make_linear(LinearSpec(hidden_size, inner, False, role="column", kind="attn.qkv"))
        self.to_k = make_linear(LinearSpec(hidden_size, inner, False, role="column", kind="attn.qkv"))
        self.to_v = make_linear(LinearSpec(hidden_size, inner, False, role="column", kind="attn.qkv"))
        self.norm_q = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        # A list of one, so the key is `to_out.0.weight` as in diffusers (whose index 1 is a no-op dropout).
        self.to_out = nn.ModuleList([make_linear(LinearSpec(inner, hidden_size, False, role="row", kind="attn.out"))])
        self.core = AttentionCore()

    def forward(
        self, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`hidden_states` `(B, S, hidden)` -> `(B, S, hidden)`; `rotary_emb` is `(cos, sin)` each `(S, rot_dim)`."""
        query = self.norm_q(self.to_q(hidden_states).unflatten(-1, (-1, self.head_dim)))
        key = self.norm_k(self.to_k(hidden_states).unflatten(-1, (-1, self.head_dim)))
        value = self.to_v(hidden_states).unflatten(-1, (-1, self.head_dim))
        if rotary_emb is not None:
            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)
        out = self.core(query, key, value).flatten(2, 3).type_as(query)
        return self.to_out[0](out)


class SwiGLUIn(nn.Module):
    """Fused up projection `[value; gate]` followed by `value * silu(gate)`."""

    def __init__(self, hidden_size: int, ffn_dim: int, make_linear: LinearFactory):
        super().__init__()
        self.proj = make_linear(
            LinearSpec(hidden_size, 2 * ffn_dim, False, role="column", kind="ffn.up", splits=(ffn_dim, ffn_dim))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.silu(gate)


class H3FeedForward(nn.Module):
    """SwiGLU feed-forward without bias. `net` mirrors diffusers' `FeedForward` so the keys are `ff.net.0.proj` and
    `ff.net.2`; index 1 (a no-op dropout there) is an identity."""

    def __init__(self, hidden_size: int, ffn_dim: int, make_linear: LinearFactory):
        super().__init__()
        down = make_linear(LinearSpec(ffn_dim, hidden_size, False, role="row", kind="ffn.down"))
        self.net = nn.ModuleList([SwiGLUIn(hidden_size, ffn_dim, make_linear), nn.Identity(), down])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class H3TokenRefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows only: no AdaLN, no RoPE."""

    def __init__(self, cfg: H3TransformerConfig, make_linear: LinearFactory):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = H3Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps, make_linear
        )
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = H3FeedForward(cfg.hidden_size, cfg.ffn_dim, make_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class H3TokenRefiner(nn.Module):
    """`num_refiner_layers` refiner blocks then a final RMSNorm."""

    def __init__(self, cfg: H3TransformerConfig, make_linear: LinearFactory):
        super().__init__()
        self.refiner_blocks = nn.ModuleList(
            [H3TokenRefinerBlock(cfg, make_linear) for _ in range(cfg.num_refiner_layers)]
        )
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.refiner_blocks:
            x = block(x)
        return self.final_norm(x)


class H3AdaLNModulation(nn.Module):
    """One block's AdaLN projection: `temb` `(K, time_embed_dim)` -> six tables `(K * 3, hidden)`
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), row `k * 3 + modality`."""

    def __init__(self, time_embed_dim: int, hidden_size: int, make_linear: LinearFactory):
        super().__init__()
        self.hidden_size = hidden_size
        out = 6 * hidden_size * NUM_MODALITIES
        self.linear = make_linear(
            LinearSpec(time_embed_dim, out, True, role="column", kind="adaln", gather_output=True)
        )

    def table(self, temb: torch.Tensor) -> torch.Tensor:
        """`(K, time_embed_dim)` -> the `(K * 3, 6 * hidden)` table, row `k * 3 + modality`."""
        # SiLU runs at temb's float32 precision and only its result is cast to the (bf16) projection: every block
        # reads the same temb, so rounding before the activation would bias all blocks the same way at every step.
        return self.linear(F.silu(temb).to(compute_dtype(self.linear))).view(-1, 6 * self.hidden_size)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.table(temb).chunk(6, dim=-1)


class H3TransformerBlock(nn.Module):
    """x += gate_msa * Attn(norm1(x) * (1 + scale_msa) + shift_msa); x += gate_mlp * FFN(norm2(x) * (1 + scale_mlp)
    + shift_mlp), the six vectors gathered per row from this block's AdaLN table."""

    def __init__(self, cfg: H3TransformerConfig, make_linear: LinearFactory):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = H3Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps, make_linear
        )
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = H3FeedForward(cfg.hidden_size, cfg.ffn_dim, make_linear)
        self.adaln_proj = H3AdaLNModulation(cfg.time_embed_dim, cfg.hidden_size, make_linear)
        # A fused implementation of `forward` with the same contract (set by `pipelines/h3/tiers.py` for the
        # `lossless` and `fast` tiers); None runs the reference op order below (`exact`).
        self.fused_forward = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        temb: torch.Tensor,
        adaln_indices: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        modulation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        Args:
            hidden_states: `(B, S, hidden)` packed stream.
            temb: `(K, time_embed_dim)` float32 timestep embeddings of the K distinct timesteps.
            adaln_indices: `(S,)` long, `timestep_index * 3 + token_tag` per row.
            rotary_emb: `(cos, sin)`, each `(S, 6 * rope_freq_dim)` float32.
            modulation: this block's precomputed `(K * 3, 6 * hidden)` AdaLN table (see `AdaLNTables`), used
                instead of projecting `temb`.
        Returns:
            `(B, S, hidden)`.
        """
        table = modulation if modulation is not None else self.adaln_proj.table(temb)
        if self.fused_forward is not None:
            return self.fused_forward(self, hidden_states, table, adaln_indices, rotary_emb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.chunk(6, dim=-1)

        def rows(table: torch.Tensor) -> torch.Tensor:
            return table.index_select(0, adaln_indices)

        normed = self.norm1(hidden_states) * (1.0 + rows(scale_msa)) + rows(shift_msa)
        hidden_states = hidden_states + rows(gate_msa) * self.attn(normed, rotary_emb)
        normed = self.norm2(hidden_states) * (1.0 + rows(scale_mlp)) + rows(shift_mlp)
        return hidden_states + rows(gate_mlp) * self.ff(normed)


class H3AdaLNOut(nn.Module):
    """Final RMSNorm with per-row shift/scale from a table indexed by timestep only (halves: shift, then scale)."""

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float, make_linear: LinearFactory):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.linear = make_linear(LinearSpec(time_embed_dim, 2 * hidden_size, True, kind="adaln"))

    def table(self, temb: torch.Tensor) -> torch.Tensor:
        """`(K, time_embed_dim)` -> `(K, 2 * hidden)`: shift then scale, one row per timestep."""
        return self.linear(F.silu(temb).to(compute_dtype(self.linear)))

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor, table: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` `(B, S, hidden)`, `temb` `(K, time_embed_dim)`, `timestep_indices` `(S,)` -> `(B, S, hidden)`;
        a precomputed `table` replaces the projection of `temb`."""
        shift, scale = (table if table is not None else self.table(temb)).chunk(2, dim=-1)
        x = self.norm(x)
        return x * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)


class H3Transformer(nn.Module):
    """MiniMax-H3 transformer (see the module docstring). Build with `from_config` / `from_pretrained`."""

    keep_fp32_modules = KEEP_FP32_MODULES

    def __init__(self, config: H3TransformerConfig | None = None, *, linear_factory: LinearFactory | None = None):
        super().__init__()
        cfg = config if config is not None else H3TransformerConfig()
        self.config = cfg
        make_linear = linear_factory or dense_linear
        hidden = cfg.hidden_size

        # 1. Per-modality input projections (the two patch projections are float32 islands).
        self.proj_in = make_linear(LinearSpec(cfg.video_patch_dim, hidden, True, kind="embed", fp32=True))
        self.audio_proj_in = make_linear(LinearSpec(cfg.audio_in_channels, hidden, True, kind="embed", fp32=True))
        self.context_embedder = make_linear(LinearSpec(cfg.text_dim, hidden, True, kind="embed"))
        # 2. Timestep MLP, shared by every AdaLN projection.
        self.time_embedder = H3TimestepEmbedding(
            cfg.freq_dim, cfg.time_embed_hidden_dim, cfg.time_embed_dim, make_linear
        )
        # 3. Rotary angles over the packed (t, h, w) grid.
        self.rope = H3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta)
        # 4. Text refiner, then the block stack.
        self.token_refiner = H3TokenRefiner(cfg, make_linear)
        self.transformer_blocks = nn.ModuleList([H3TransformerBlock(cfg, make_linear) for _ in range(cfg.num_layers)])
        # 5. Output norm and the two heads (float32 islands), each run over every row.
        self.norm_out = H3AdaLNOut(hidden, cfg.time_embed_dim, cfg.final_norm_eps, make_linear)
        self.proj_out = make_linear(LinearSpec(hidden, cfg.video_patch_dim, True, kind="head", fp32=True))
        self.audio_proj_out = make_linear(LinearSpec(hidden, cfg.audio_in_channels, True, kind="head", fp32=True))
        # The running request's first-block step cache (`step_cache.StepCache`, quality high), or None.
        self.step_cache = None

    @classmethod
    def from_config(cls, config: dict[str, Any] | H3TransformerConfig, **kwargs) -> "H3Transformer":
        """Random-initialised model from a config dict (diffusers `config.json` contents) or config object."""
        if isinstance(config, dict):
            config = H3TransformerConfig.from_dict(config)
        return cls(config, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        folder,
        torch_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        linear_factory: LinearFactory | None = None,
        qkv_layout: str = "interleaved",
        parallel=None,
        quantization: str | None = None,
        skip_prefixes: tuple[str, ...] = (),
        tensors=None,
    ) -> "H3Transformer":
        """Load from a folder holding `config.json` and safetensors weights (one file or a sharded index), in the
        diffusers key layout or the original release's. Float32 islands stay float32; everything else becomes
        `torch_dtype`. Built on the meta device and filled one tensor at a time (no full-precision copy).

        `qkv_layout` only matters for the original layout: "interleaved" (per-head `[q k v]`, the MiniMaxAI shards)
        or "stacked" (`[q; k; v]`, published single files). `parallel` (an `h3gen.parallel.ParallelState`) loads
        this rank's tensor-parallel shard (reading only that part of each tensor) and splits the sequence (Ulysses).
        `quantization="mxfp4"` stores the block linears (q/k/v/out, SwiGLU, AdaLN) as MXFP4, quantized while each
        tensor is read. Tensors under `skip_prefixes` are not read and stay on the meta device (a rank that maps
        the blocks from a shared host store skips "transformer_blocks."). `tensors` (`(key, tensor)` pairs in the
        diffusers layout) replaces the folder's weight files (random weights at released dims).
        """
        return load_transformer(
            cls,
            folder,
            torch_dtype=torch_dtype,
            device=device,
            linear_factory=linear_factory,
            qkv_layout=qkv_layout,
            parallel=parallel,
            quantization=quantization,
            skip_prefixes=skip_prefixes,
            tensors=tensors,
        )

    @torch.no_grad()
    def precompute_adaln(self, step_timesteps: list[torch.Tensor]) -> AdaLNTables:
        """AdaLN tables for a whole request: `step_timesteps[i]` is step i's `(K_i,)` distinct timesteps (the
        `timestep` argument `forward` would get). Pass the result to `forward(..., adaln_tables=, step=i)`."""
        counts = [t.numel() for t in step_timesteps]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        timesteps = torch.cat([t.to(self.device) for t in step_timesteps])
        temb = self.time_embedder(
            timestep_sinusoids(timesteps, self.config.freq_dim).to(compute_dtype(self.time_embedder.linear_1))
        )
        blocks = [block.adaln_proj.table(temb) for block in self.transformer_blocks]
        return AdaLNTables(blocks=blocks, final=self.norm_out.table(temb), offsets=offsets, counts=counts)

    def save_pretrained(self, folder, max_shard_bytes: int | None = None):
        """Write `config.json` and the weights in diffusers' layout (loadable by diffusers and by us)."""
        config = self.config.to_dict()
        if getattr(self, "quantization", None):
            config["quantization_config"] = {"quant_method": self.quantization}
        return save_component(folder, config, self.state_dict(), max_shard_bytes=max_shard_bytes)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the block stack (the model's working precision)."""
        return compute_dtype(self.context_embedder)

    @property
    def device(self) -> torch.device:
        return self.context_embedder.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        adaln_tables: AdaLNTables | None = None,
        step: int | None = None,
    ) -> H3TransformerOutput | tuple[torch.Tensor, torch.Tensor]:
        """One denoising forward over a packed sequence of S = N_text + N_video + N_audio rows.

        Args:
            hidden_states: `(B, N_video, video_patch_dim)` patchified video rows in `video_indices` order
                (conditioning rows first).
            audio_hidden_states: `(B, N_audio, audio_in_channels)` audio rows in `audio_indices` order.
            encoder_hidden_states: `(B, N_text, text_dim)` text-encoder states in `text_indices` order.
            timestep: `(K,)` the distinct timesteps, unscaled in [0, 1], t = 1 clean.
            timestep_indices: `(S,)` long, per row index into `timestep`.
            token_tags: `(S,)` long, per row modality: 0 video, 1 text, 2 audio.
            position_ids: `(S, 3)` (t, h, w) rotary coordinates (float64 from packing; used in float32).
            video_indices, audio_indices, text_indices: 1-D long, sequence positions of each modality's rows.
            attention_kwargs: accepted for diffusers compatibility; LoRA scaling is not supported yet and a
                `scale` other than 1.0 is rejected.
            return_dict: return `H3TransformerOutput` (default) or a `(video, audio)` tuple.
            adaln_tables, step: precomputed AdaLN tables (`precompute_adaln`) and this forward's step in them; the
                tables must have been built from the same `timestep`.

        Returns:
            video velocity `(B, N_video, video_patch_dim)` and audio velocity `(B, N_audio, audio_in_channels)`,
            float32 when the heads are float32 (the released checkpoint).
        """
        if attention_kwargs and attention_kwargs.get("scale", 1.0) != 1.0:
            raise ValueError("LoRA scaling via attention_kwargs['scale'] is not supported by H3Transformer yet.")
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must be a (seq_len, 3) tensor, got {list(position_ids.shape)}.")
        seq_len = position_ids.shape[0]
        if token_tags.shape != (seq_len,) or timestep_indices.shape != (seq_len,):
            raise ValueError(
                "token_tags and timestep_indices must be (seq_len,) tensors matching position_ids, got "
                f"{list(token_tags.shape)} and {list(timestep_indices.shape)} for seq_len={seq_len}."
            )
        rows = video_indices.numel() + audio_indices.numel() + text_indices.numel()
        if rows != seq_len:
            raise ValueError(f"The index tensors address {rows} rows but position_ids has {seq_len}.")

        rotary_emb = self.rope(position_ids)

        # 1. Project each modality (inputs aligned with each projection's dtype: the patch projections are float32
        # islands) and scatter into the packed buffer, which takes the text stream's dtype.
        video = self.proj_in(hidden_states.to(compute_dtype(self.proj_in)))
        audio = self.audio_proj_in(audio_hidden_states.to(compute_dtype(self.audio_proj_in)))
        text = self.token_refiner(self.context_embedder(encoder_hidden_states.to(compute_dtype(self.context_embedder))))
        x = text.new_zeros((text.shape[0], seq_len, text.shape[-1]))
        x = x.index_copy(1, text_indices, text)
        x = x.index_copy(1, video_indices, video.to(text.dtype))
        x = x.index_copy(1, audio_indices, audio.to(text.dtype))

        # 2. One float32 embedding per distinct timestep; each AdaLN projection activates and casts it itself
        # (or the request's tables were computed up front).
        adaln_indices = timestep_indices * NUM_MODALITIES + token_tags
        if adaln_tables is not None:
            temb = None
            block_tables, final_table = adaln_tables.for_step(step)
        else:
            temb = timestep_sinusoids(timestep, self.config.freq_dim)
            temb = self.time_embedder(temb.to(compute_dtype(self.time_embedder.linear_1)))
            block_tables, final_table = [None] * len(self.transformer_blocks), None

        blocks = self.transformer_blocks

        def run_block(index: int, x: torch.Tensor) -> torch.Tensor:
            return blocks[index](x, temb, adaln_indices, rotary_emb, modulation=block_tables[index])

        if self.step_cache is not None:  # may skip blocks 1..N-1 and reuse their last residual
            x = self.step_cache.run_blocks(len(blocks), x, run_block, blocks[0] if len(blocks) else None)
        else:
            for index in range(len(blocks)):
                x = run_block(index, x)

        # 3. Both heads over every row, then each modality's rows are selected.
        x = self.norm_out(x, temb, timestep_indices, table=final_table).to(compute_dtype(self.proj_out))
        video_out = self.proj_out(x).index_select(1, video_indices)
        audio_out = self.audio_proj_out(x).index_select(1, audio_indices)
        if not return_dict:
            return video_out, audio_out
        return H3TransformerOutput(sample=video_out, audio_sample=audio_out)
