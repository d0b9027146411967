"""The layers of the MiniMax-H3 transformer (`transformer.H3Transformer`): rotary and timestep embeddings,
attention (through the replaceable `AttentionCore` of `h3gen.kernels.attention_core`), the SwiGLU feed-forward, the
text refiner, the AdaLN projections and norms, and `H3TransformerBlock`, self-contained so that offload can move it
as a unit. Every linear comes from a `LinearFactory` (`h3gen.linear`)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.attention_core import AttentionCore
from h3gen.kernels.vsa_h3 import SparseSwitch
from h3gen.linear import LinearFactory, LinearSpec
from h3gen.pipelines.h3.transformer_config import NUM_MODALITIES, H3TransformerConfig


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


class H3Attention(nn.Module):
    """Bias-free q/k/v, per-head RMSNorm on q and k, optional RoPE, full attention, output projection. A VSA student's
    blocks also have `to_gate_compress` (`gates=True`), the bias-free gate of VSA-H3's compression branch, computed
    from the same input as q/k/v with no activation (FastVideo `models/dits/minimax_h3.py`).

    Heads are inferred from the projection width, so a column-sharded `to_q` simply yields fewer local heads.
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        head_dim: int,
        qk_norm_eps: float,
        make_linear: LinearFactory,
        *,
        gates: bool = False,
        sparse: SparseSwitch | None = None,
    ):
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
        # Column-sharded with the heads under TP; never quantized (its kind is in no quantized list).
        self.to_gate_compress = (
            make_linear(LinearSpec(hidden_size, inner, False, role="column", kind="attn.gate")) if gates else None
        )
        self.core = AttentionCore(sparse=sparse)

    def gate(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The compression gate `(B, S, heads, head_dim)` of the attention input `(B, S, hidden)`, or None."""
        if self.to_gate_compress is None:
            return None
        return self.to_gate_compress(hidden_states).unflatten(-1, (-1, self.head_dim))

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
        out = self.core(query, key, value, self.gate(hidden_states)).flatten(2, 3).type_as(query)
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

    def __init__(
        self,
        cfg: H3TransformerConfig,
        make_linear: LinearFactory,
        *,
        gates: bool = False,
        sparse: SparseSwitch | None = None,
    ):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = H3Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            cfg.qk_norm_eps,
            make_linear,
            gates=gates,
            sparse=sparse,
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
