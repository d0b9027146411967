"""The K3 / Kimi-Linear text model: Kimi Delta Attention and gated MLA layers interleaved, dense or (Latent)MoE
feed-forwards with SiLU or SiTU experts, and either the plain residual stream or block Attention Residuals.

State-dict keys equal the checkpoint's after the loader's renames (`block_sparse_moe` -> `mlp`, A_log flattened),
so `model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.mlp.experts.{e}.w1.weight_packed`, ... Linear
layers come from a `LinearFactory` (tensor parallel and MXFP4 factories plug in there); the math of the fast ops
lives in `h3gen.kernels.kda`, `h3gen.kernels.mla_decode` and `h3gen.kernels.moe`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.argmax import argmax_rows
from h3gen.kernels.embedding import embedding_rows
from h3gen.kernels.gemv import MAX_ROWS, grouped_rows_linear, rows_linear
from h3gen.kernels.kda import kda_chunked, kda_decode, kda_gate, l2_normalize, short_conv
from h3gen.kernels.mla_decode import absorb_output, absorb_query, mla_decode, mla_decode_partials, mla_decode_splits
from h3gen.kernels.moe import expert_swiglu_down
from h3gen.kernels.rmsnorm import rms_norm
from h3gen.kernels.swiglu import swiglu
from h3gen.linear import LinearFactory, LinearSpec, dense_linear, to_mxfp4
from h3gen.pipelines.k3.cache import K3Cache, KDAState, PagedLatentCache
from h3gen.pipelines.k3 import moe
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.loader import load_k3
from h3gen.pipelines.k3.moe import K3Expert, K3Router, stack_weights
from h3gen.pipelines.k3.pending_norm import PendingNorm, linear_rows, linear_rows_argmax, resolved
from h3gen.pipelines.k3.vision import K3MultiModalProjector, K3VisionConfig, K3VisionTower


class K3RMSNorm(nn.Module):
    """RMSNorm computed in float32; the normalised value is cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class K3ShortConv(nn.Module):
    """Holder of one depthwise causal conv weight `[C, 1, W]` (float32, as K3 stores and uses it)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width))


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU: `beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta)`, float32, cast back."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def gated_activation(config: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ_and_mul(gate, up, config.situ_beta, config.situ_linear_beta)
    return F.silu(gate) * up


@torch.no_grad()
def fuse_linears(layers: list[nn.Module]) -> torch.Tensor | None:
    """Move the weights of plain bias-free `nn.Linear`s that read the same input into one `[sum of outputs, in]`
    tensor and point each layer's weight at its rows of it, so one GEMM computes them all (`F.linear(x, fused)`
    split by output widths); state-dict keys and values do not change. None, changing nothing, when any layer is
    something else (quantized, tensor parallel, with a bias) or they differ in input width, dtype or device."""
    if not layers or any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
        return None
    first = layers[0].weight
    if any(layer.weight.shape[1] != first.shape[1] or layer.weight.dtype != first.dtype
           or layer.weight.device != first.device for layer in layers):
        return None
    fused = first.new_empty(sum(layer.weight.shape[0] for layer in layers), first.shape[1])
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        fused[start : start + rows].copy_(layer.weight)
        layer.weight.data = fused[start : start + rows]
        start += rows
    return fused


@torch.no_grad()
def stack_linears(layers: list[nn.Module]) -> torch.Tensor | None:
    """Like `fuse_linears` for bias-free linears of one shape that read different inputs: their weights moved into
    one `[len(layers), out, in]` tensor (each layer's weight re-pointed at its slice), for one batched GEMM. None,
    changing nothing, when they are not all plain `nn.Linear`s of one shape, dtype and device."""
    if not layers or any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
        return None
    first = layers[0].weight
    if any(layer.weight.shape != first.shape or layer.weight.dtype != first.dtype
           or layer.weight.device != first.device for layer in layers):
        return None
    stacked = torch.stack([layer.weight for layer in layers])
    for layer, weight in zip(layers, stacked):
        layer.weight.data = weight
    return stacked


def fused_outputs(fused: torch.Tensor, layers: list[nn.Module], x: torch.Tensor | PendingNorm) -> list[torch.Tensor]:
    """The outputs of `layers` (fused by `fuse_linears`) for `x`, from one GEMM (`rows_linear`; for a pending norm,
    the GEMM computes the norm)."""
    return list(linear_rows(x, fused).split([layer.weight.shape[0] for layer in layers], dim=-1))


def project(layer: nn.Module, x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """`layer(x)`, where a plain bias-free `nn.Linear` goes through `rows_linear`: a decode step's few rows then take
    the few-row kernel (`h3gen.kernels.gemv`), anything else `F.linear` as before. Other linears (quantized,
    tensor parallel) are called as they are."""
    if type(layer) is nn.Linear and layer.bias is None:
        return linear_rows(x, layer.weight)
    return layer(resolved(x))


def project_argmax(layer: nn.Module, x: torch.Tensor | PendingNorm,
                   into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`project(layer, x)` `[..., N]`, its argmax over N `[...]` int64, written into `into` (contiguous, one per
    row) when given); for a decode step's few rows through a plain linear, the GEMV kernel finds the argmax as it
    writes the output (`rows_linear_argmax`)."""
    if type(layer) is nn.Linear and layer.bias is None:
        return linear_rows_argmax(x, layer.weight, into)
    out = layer(resolved(x))
    index = argmax_rows(out.reshape(-1, out.shape[-1]))
    if into is not None:
        index = into.copy_(index)
    return out, index.view(out.shape[:-1])


class K3DeltaAttention(nn.Module):
    """Kimi Delta Attention: short conv + SiLU on q/k/v, L2-normalised q/k, per-channel decay gate, sigmoid beta,
    the delta-rule recurrence (`h3gen.kernels.kda`), then a per-head RMSNorm times a sigmoid output gate."""

    def __init__(self, config: K3Config, linear: LinearFactory):
        super().__init__()
        d, h, k = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.config, self.num_heads, self.head_dim = config, h, k
        width = h * k
        self.q_proj = linear(LinearSpec(d, width, False, "column", "attn.qkv"))
        self.k_proj = linear(LinearSpec(d, width, False, "column", "attn.qkv"))
        self.v_proj = linear(LinearSpec(d, width, False, "column", "attn.qkv"))
        self.q_conv1d = K3ShortConv(width, config.conv_kernel_size)
        self.k_conv1d = K3ShortConv(width, config.conv_kernel_size)
        self.v_conv1d = K3ShortConv(width, config.conv_kernel_size)
        self.f_a_proj = linear(LinearSpec(d, k, False, "replicated", "attn.gate"))
        self.f_b_proj = linear(LinearSpec(k, width, False, "column", "attn.gate"))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = linear(LinearSpec(d, h, False, "column", "attn.gate"))
        if config.use_full_rank_gate:
            self.g_proj = linear(LinearSpec(d, width, False, "column", "attn.qkv"))
        else:
            self.g_a_proj = linear(LinearSpec(d, k, False, "replicated", "attn.gate"))
            self.g_b_proj = linear(LinearSpec(k, width, False, "column", "attn.gate"))
        self.o_norm = K3RMSNorm(k, config.linear_norm_eps)
        self.o_proj = linear(LinearSpec(width, d, False, "row", "attn.out"))
        self.fused_in: torch.Tensor | None = None  # see `fuse_projections`
        self.fused_up_gates: torch.Tensor | None = None  # [f_b; g_b] `[2, width, k]`, see `fuse_projections`

    def _input_layers(self) -> list[nn.Module]:
        """The projections of the input, in the fused GEMM's order: the two low-rank gate inputs last, side by
        side, so their outputs are one `[B, 2, k]` slice for the batched up-projection."""
        if self.config.use_full_rank_gate:
            return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_proj]
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_a_proj]

    def fuse_projections(self) -> bool:
        """One GEMM for every projection of the input (q, k, v, beta and the gate inputs; see `fuse_linears`) and,
        with low-rank gates, one batched GEMM for both gate up-projections (`stack_linears`)."""
        if self.fused_in is None:
            self.fused_in = fuse_linears(self._input_layers())
        if self.fused_up_gates is None and not self.config.use_full_rank_gate and self.fused_in is not None:
            self.fused_up_gates = stack_linears([self.f_b_proj, self.g_b_proj])
        return self.fused_in is not None

    def forward(self, x: torch.Tensor | PendingNorm,
                state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
        """`x` `[B, T, D]` (after the pre-norm, or a `PendingNorm`), `state` from the previous call or None ->
        (`[B, T, D]`, new state).

        One token with a state takes the fused decode op (its conv and recurrent states are updated in place and
        returned); anything else the chunked recurrence (prefill, or a prefill chunk continuing from `state`)."""
        b, t, _ = x.shape
        if t == 1 and state is not None:
            return self._decode(x, state), state
        x = resolved(x)
        shape = (b, t, self.num_heads, self.head_dim)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        qkv, conv_state = short_conv(qkv, conv_weight, None if state is None else state.conv)
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        q, k = l2_normalize(q.reshape(shape)), l2_normalize(k.reshape(shape))
        v = v.reshape(shape)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(shape), self.A_log, self.dt_bias,
                     self.config.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        initial = None if state is None else state.recurrent
        o, recurrent = kda_chunked(q, k, v.float(), g, beta, self.head_dim ** -0.5, initial)
        gate = self.g_proj(x) if self.config.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        # Output norm and gate in float32, as fla's FusedRMSNormGated.
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
        o = (of * torch.sigmoid(gate.float().view(shape))).to(x.dtype)
        return project(self.o_proj, o.reshape(b, t, -1)), KDAState(conv_state, recurrent)

    def _decode(self, x: torch.Tensor | PendingNorm, state: KDAState) -> torch.Tensor:
        """One token `x` `[B, 1, D]` -> `[B, 1, D]` through `kda_decode` (conv, norms, gates, recurrence fused)."""
        if self.fused_in is not None:
            q, k, v, b, f_a, gate = (out[:, 0] for out in fused_outputs(self.fused_in, self._input_layers(), x))
        else:
            row = resolved(x)[:, 0]
            q, k, v, b = self.q_proj(row), self.k_proj(row), self.v_proj(row), self.b_proj(row)
            f_a = self.f_a_proj(row)
            gate = self.g_proj(row) if self.config.use_full_rank_gate else self.g_a_proj(row)
        gate_up = None
        if self.fused_up_gates is not None and q.shape[0] <= MAX_ROWS:
            # a few tokens: the decode op projects the low-rank gates up itself (no GEMV kernel of their own)
            f, gate_up = f_a, self.fused_up_gates
        elif self.fused_up_gates is not None:
            # f_a and g_a sit side by side in the fused output's rows: one [2, B, k] view, one batched GEMM
            rank = f_a.shape[-1]
            pairs = f_a.as_strided((2, f_a.shape[0], rank), (rank, f_a.stride(0), 1))
            f, gate = grouped_rows_linear(pairs, self.fused_up_gates)
        else:
            f = self.f_b_proj(f_a)
            if not self.config.use_full_rank_gate:
                gate = self.g_b_proj(gate)
        o = kda_decode(q, k, v, (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight), state.conv,
                       f, self.A_log, self.dt_bias, self.config.gate_lower_bound, b, gate,
                       self.o_norm.weight, self.o_norm.eps, state.recurrent, self.head_dim ** -0.5, rows=state.rows,
                       gate_up=gate_up)
        return project(self.o_proj, o)[:, None]


class K3MLAttention(nn.Module):
    """Multi-head latent attention without rotary embedding (the `k_pe` part is still one shared head), with K3's
    optional sigmoid output gate. Prefill expands the latents per head; decode runs in the absorbed form against
    the paged latent cache (`h3gen.kernels.mla_decode`)."""

    def __init__(self, config: K3Config, linear: LinearFactory):
        super().__init__()
        d, n = config.hidden_size, config.num_attention_heads
        self.config, self.num_heads = config, n
        self.nope, self.rope, self.v_dim, self.rank = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                                       config.v_head_dim, config.kv_lora_rank)
        qk = config.mla_head_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(LinearSpec(d, n * qk, False, "column", "attn.qkv"))
        else:
            self.q_a_proj = linear(LinearSpec(d, config.q_lora_rank, False, "replicated", "attn.qkv"))
            self.q_a_layernorm = K3RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = linear(LinearSpec(config.q_lora_rank, n * qk, False, "column", "attn.qkv"))
        self.kv_a_proj_with_mqa = linear(LinearSpec(d, self.rank + self.rope, False, "replicated", "attn.qkv"))
        self.kv_a_layernorm = K3RMSNorm(self.rank, config.mla_norm_eps)
        self.kv_b_proj = linear(LinearSpec(self.rank, n * (self.nope + self.v_dim), False, "column", "attn.qkv"))
        if config.mla_use_output_gate:
            self.g_proj = linear(LinearSpec(d, n * self.v_dim, False, "column", "attn.gate"))
        self.o_proj = linear(LinearSpec(n * self.v_dim, d, False, "row", "attn.out"))
        self.scale = qk ** -0.5
        self.fused_in: torch.Tensor | None = None  # see `fuse_projections`

    def _input_layers(self) -> list[nn.Module]:
        first = self.q_proj if self.config.q_lora_rank is None else self.q_a_proj
        gate = [self.g_proj] if self.config.mla_use_output_gate else []
        return [first, self.kv_a_proj_with_mqa, *gate]

    def fuse_projections(self) -> bool:
        """One GEMM for the projections of the input (q or its low-rank part, the latent KV, the gate)."""
        if self.fused_in is None:
            self.fused_in = fuse_linears(self._input_layers())
        return self.fused_in is not None

    def forward(self, x: torch.Tensor | PendingNorm, cache: PagedLatentCache | None = None) -> torch.Tensor:
        """`x` `[B, T, D]` (or a `PendingNorm`) -> `[B, T, D]`; appends this call's latent rows to `cache` when
        given."""
        b, t, _ = x.shape
        if self.fused_in is not None:
            q, kv, *gate = fused_outputs(self.fused_in, self._input_layers(), x)
        else:
            x = resolved(x)
            q = self.q_proj(x) if self.config.q_lora_rank is None else self.q_a_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
            gate = [self.g_proj(x)] if self.config.mla_use_output_gate else []
        if self.config.q_lora_rank is not None:  # a decode step's q_b kernel normalises q itself
            q = project(self.q_b_proj, PendingNorm(q, None, self.q_a_layernorm) if b * t <= MAX_ROWS
                        else self.q_a_layernorm(q))
        q = q.view(b, t, -1, self.nope + self.rope)
        heads = q.shape[2]
        latent, k_pe = kv.split([self.rank, self.rope], dim=-1)
        past = 0 if cache is None else cache.length
        if cache is not None and t == 1 and past > 0:  # decode: the absorbed form, the output gate fused in
            new_rows = None
            if hasattr(cache, "normed_row_write"):  # a captured decode step: norm, concatenation and write are
                new_rows = cache.normed_row_write(latent, k_pe, self.kv_a_layernorm)  # done by the query's op
            else:
                cache.append(torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1))
            gate_row = gate[0][:, 0] if self.config.mla_use_output_gate else None
            o = self._decode_absorbed(q[:, 0], cache, gate_row, new_rows).unsqueeze(1)
        else:
            row = torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)  # [B, T, r + d_r], what the cache holds
            if cache is not None:
                cache.append(row)
            rows = cache.rows() if cache is not None else row
            o = self._attend_expanded(q, rows.to(x.dtype), past)
            if self.config.mla_use_output_gate:
                o = o * torch.sigmoid(gate[0]).view_as(o)
        return project(self.o_proj, o.reshape(b, t, heads * self.v_dim))

    def _attend_expanded(self, q: torch.Tensor, rows: torch.Tensor, past: int) -> torch.Tensor:
        """Prefill: expand every cached latent to per-head keys and values. `q` `[B, T, n, qk]`, `rows`
        `[B, past + T, r + d_r]` -> `[B, T, n, v]`."""
        b, t, n, _ = q.shape
        length = rows.shape[1]
        latent, k_pe = rows.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(b, length, n, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(b, length, n, self.rope)], dim=-1)
        causal = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(diagonal=past)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=causal, scale=self.scale)
        return o.transpose(1, 2)

    def _decode_absorbed(self, q: torch.Tensor, cache: PagedLatentCache, gate: torch.Tensor | None = None,
                         new_rows: tuple | None = None) -> torch.Tensor:
        """Decode: fold `kv_b_proj` into the query and the output, so attention runs over the cached latent rows
        directly (one KV head of width r + d_r). `q` `[B, n, qk]` -> `[B, n, v]`, times sigmoid(`gate` `[B, n v]`)
        when given. `new_rows`: the step's cache rows (`write_latent_rows`' arguments) when not yet written; the
        query's op writes them. On a GPU each sequence's rows are split over several programs, combined in the
        output op."""
        w_kc, w_vc = self._absorbed_weights(q.shape[1])
        query = absorb_query(q, w_kc, self.nope, new_rows)
        splits = mla_decode_splits(q.shape[0], q.device)
        if splits == 1:
            latent = mla_decode(query, cache.pages, cache.block_table(), cache.seq_lens(), self.scale, self.rank)
            return absorb_output(latent, w_vc, q.dtype, gate)
        runs, lse = mla_decode_partials(query, cache.pages, cache.block_table(), cache.seq_lens(), self.scale,
                                        self.rank, splits)
        return absorb_output(runs, w_vc, q.dtype, gate, lse)

    def _absorbed_weights(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj`'s weight seen per head as `W_kc` `[n, d_n, r]` and `W_vc` `[n, d_v, r]` (views, no copy;
        the decode ops multiply in float32)."""
        w = self.kv_b_proj.weight.detach().view(heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope:]


class K3MLP(nn.Module):
    """Gated MLP `down(act(gate x, up x))` with SiLU or SiTU: the dense layers and the shared experts."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int, linear: LinearFactory, kind: str = "ffn"):
        super().__init__()
        self.config = config
        self.gate_proj = linear(LinearSpec(hidden, intermediate, False, "column", f"{kind}.up"))
        self.up_proj = linear(LinearSpec(hidden, intermediate, False, "column", f"{kind}.up"))
        self.down_proj = linear(LinearSpec(intermediate, hidden, False, "row", f"{kind}.down"))
        self.fused_in: torch.Tensor | None = None  # [up; gate], see `fuse_projections`

    def fuse_projections(self) -> bool:
        """One GEMM for up and gate (in that order, the layout `swiglu` reads); see `fuse_linears`."""
        if self.fused_in is None:
            self.fused_in = fuse_linears([self.up_proj, self.gate_proj])
        return self.fused_in is not None

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if self.fused_in is not None:
            both = linear_rows(x, self.fused_in)
            if self.config.hidden_act != "situ":
                return project(self.down_proj, swiglu(both))
            up, gate = both.chunk(2, dim=-1)
            return project(self.down_proj, gated_activation(self.config, gate, up))
        x = resolved(x)
        return self.down_proj(gated_activation(self.config, self.gate_proj(x), self.up_proj(x)))


class K3MoE(nn.Module):
    """Routed experts (in a latent space for LatentMoE) plus shared experts at full width:

        w, ids = router(x)                         on the full width
        h = down(x)                                LatentMoE only
        y = sum_k w_k E_{ids_k}(h)                 E(h) = w2 act(w1 h, w3 h)
        y = up(RMSNorm(y))                         LatentMoE only (the norm when latent_moe_use_norm)
        out = y + shared(x)

    How the routed sum runs (grouped GEMMs, stacked blocks, per-pair GEMVs, dense or MXFP4) is in `moe.py`;
    `routed` picks one by batch size and by how the experts hold their weights.
    """

    def __init__(self, config: K3Config, linear: LinearFactory):
        super().__init__()
        self.config = config
        d = config.hidden_size
        width = config.routed_expert_hidden_size or d
        self.gate = K3Router(config)
        if config.routed_expert_hidden_size:
            self.routed_expert_down_proj = linear(LinearSpec(d, width, False, "replicated", "moe.latent"))
            if config.latent_moe_use_norm:
                self.routed_expert_norm = K3RMSNorm(width, config.rms_norm_eps)
            self.routed_expert_up_proj = linear(LinearSpec(width, d, False, "replicated", "moe.latent"))
        self.experts = nn.ModuleList(
            K3Expert(width, config.moe_intermediate_size, linear) for _ in range(config.num_experts))
        if config.num_shared_experts:
            self.shared_experts = K3MLP(config, d, config.moe_intermediate_size * config.num_shared_experts, linear,
                                        "ffn")
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (up_gate [E, 2I, W], down [E, W, I])
        # MXFP4 experts stacked: ((packed, scales) of up_gate, (packed, scales) of down)
        self.stacked_mxfp4: tuple | None = None
        self.shared_in_stack = False  # the shared expert is stacked expert E (see `stack_experts`)
        # (zeros [R, 1] int64, ones [R, 1] float32): the one-slot routing of the shared expert's decode tail
        self.one_slot: tuple[torch.Tensor, torch.Tensor] | None = None

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gated_activation(self.config, gate, up)

    @torch.no_grad()
    def stack_experts(self) -> bool:
        """Move the experts' weights into stacked tensors (`moe.stack_weights`; do it after moving the model to its
        device): dense experts into `stacked` = (`up_gate` `[E, 2I, W]`, `down` `[E, W, I]`), MXFP4 experts' packed
        bytes and scales the same way (`stacked_mxfp4`). Few-token batches then pick their experts on the device,
        with no host synchronisation. Returns False, changing nothing, for other layers."""
        if self.stacked is not None or self.stacked_mxfp4 is not None:
            return True
        layers = [layer for expert in self.experts for layer in (expert.w1, expert.w3, expert.w2)]
        if all(hasattr(layer, "weight_packed") for layer in layers):
            packed = stack_weights(list(self.experts), "weight_packed")
            scales = stack_weights(list(self.experts), "weight_scale")
            self.stacked_mxfp4 = ((packed[0], scales[0]), (packed[1], scales[1]))
        elif all(isinstance(getattr(layer, "weight", None), torch.Tensor) and not hasattr(layer, "weight_packed")
                 for layer in layers):
            shared = self._mergeable_shared_expert()
            self.stacked = stack_weights(list(self.experts), "weight", shared)
            self.shared_in_stack = shared is not None
        else:
            return False
        down = getattr(getattr(self, "shared_experts", None), "down_proj", None)
        if not self.shared_in_stack and type(down) is nn.Linear and down.bias is None:
            self.one_slot = (torch.zeros(MAX_ROWS, 1, dtype=torch.long, device=down.weight.device),
                             torch.ones(MAX_ROWS, 1, dtype=torch.float32, device=down.weight.device))
        return True

    def _mergeable_shared_expert(self) -> "K3MLP | None":
        """The shared expert when it can run as one more stacked expert (same input width and intermediate size as
        the routed experts, one of it, plain bf16/fp32 linears like theirs): then few-token batches route every token
        to it too, with weight 1, and its three GEMMs, activation and add disappear from a decode step."""
        c = self.config
        shared = getattr(self, "shared_experts", None)
        if shared is None or c.num_shared_experts != 1 or c.routed_expert_hidden_size:
            return None
        layers = (shared.up_proj, shared.gate_proj, shared.down_proj)
        first = self.experts[0]
        if any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
            return None
        if (shared.up_proj.weight.shape != first.w3.weight.shape or shared.down_proj.weight.shape != first.w2.weight.shape
                or any(layer.weight.dtype != first.w1.weight.dtype or layer.weight.device != first.w1.weight.device
                       for layer in layers)):
            return None
        return shared

    def routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, always: int = 0) -> torch.Tensor:
        """`h` `[T, W]` -> `sum_k weights[:, k] E_{ids[:, k]}(h)` `[T, W]`. Few pairs with stacked experts: one GEMV
        per (token, expert) pair; more: blocks per expert over the stacked weights (stacked MXFP4 experts widened to
        the compute dtype for the call); experts not stacked: grouped GEMMs. `always`: the last that many slots are
        always-on experts stacked after the routed ones (see `stack_experts`)."""
        swiglu = self.config.hidden_act != "situ"
        if self.stacked_mxfp4 is not None:
            if ids.numel() <= moe.MXFP4_DEVICE_ROUTING_MAX_PAIRS:
                return moe.per_pair_mxfp4(h, weights, ids, self.stacked_mxfp4, self.experts[0].w1.compute_dtype,
                                          self._activation, swiglu)
            # a prefill: every expert is likely picked, widen them all once
            up_gate, down = moe.widened_mxfp4(self.stacked_mxfp4, self.experts[0].w1.compute_dtype, h.shape[-1])
            return moe.stacked_blocks(h.to(up_gate.dtype), weights, ids, up_gate, down, self._activation, swiglu)
        if self.stacked is not None:
            if ids.numel() <= moe.DEVICE_ROUTING_MAX_PAIRS:
                return moe.per_pair(h, weights, ids, *self.stacked, self._activation, swiglu, always)
            return moe.stacked_blocks(h, weights, ids, *self.stacked, self._activation, swiglu)
        return moe.grouped_by_expert(h, weights, ids, list(self.experts), self._activation)

    def _always(self, tokens: int) -> int:
        """Always-on experts the router appends for a batch of `tokens`: the shared expert, when it rides in the
        stack as expert E (weight 1) for few tokens (see `stack_experts`)."""
        merged = self.shared_in_stack and tokens * self.config.num_experts_per_token <= moe.DEVICE_ROUTING_MAX_PAIRS
        return 1 if merged else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x, always=self._always(x.shape[0]))
        return self.from_routing(x, weights, ids).view(shape)

    def after_residual(self, h: torch.Tensor, delta: torch.Tensor,
                       norm: K3RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`(h + delta, self(norm(h + delta)))` with the residual update, the norm and the router as one op
        (`K3Router.after_residual`): a decode step's MoE layer starts with one kernel instead of three."""
        shape, width = h.shape, h.shape[-1]
        total, normed, weights, ids = self.gate.after_residual(h.reshape(-1, width), delta.reshape(-1, width), norm,
                                                               always=self._always(h.numel() // width))
        return total.view(shape), self.from_routing(normed, weights, ids).view(shape)

    def from_routing(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The layer's output for `x` `[T, D]` routed to `ids` with `weights` (the router's output for x)."""
        always = self._always(x.shape[0])
        if always:  # the shared expert is in the routing, as expert E
            return self.routed(x, weights, ids, always)
        shared_both = self._shared_up_gate(x)
        if self.config.routed_expert_hidden_size:
            y = self.routed(self.routed_expert_down_proj(x), weights, ids)
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x, weights, ids)
        if shared_both is not None:  # the shared expert's SwiGLU and down, plus the routed output, in one op
            zeros, ones = (t[: x.shape[0]] for t in self.one_slot)
            return expert_swiglu_down(shared_both, self.shared_experts.down_proj.weight[None], zeros, ones, add=y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    def _shared_up_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a decode step of up to `MAX_ROWS` tokens with a shared expert not riding in the stack (MXFP4
        experts; see `stack_experts`): its fused [up; gate] projection `[T, 2I]`, computed before the routed
        experts (its weights need no routing, so they load while the router runs); else None."""
        shared = getattr(self, "shared_experts", None)
        if (self.one_slot is None or shared is None or shared.fused_in is None or x.shape[0] > MAX_ROWS
                or self.config.hidden_act == "situ"):
            return None
        return rows_linear(x, shared.fused_in)


def quantize_experts_mxfp4(model: nn.Module) -> nn.Module:
    """Replace every routed expert's linears by `MXFP4Linear`s quantized from them (the format K3 checkpoints ship
    their experts in), where the model is; returns the model."""
    for expert in [m for m in model.modules() if isinstance(m, K3Expert)]:
        for name in ("w1", "w2", "w3"):
            setattr(expert, name, to_mxfp4(getattr(expert, name)))
    return model


class K3ResidualQuery(nn.Module):
    """An AttnRes pseudo-query `[1, D]` (stored like a linear weight)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))


def attn_res_mix(rows: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    """Block AttnRes read: `softmax_j(q · RMSNorm_γ(R_j))`-weighted sum of the raw rows `R_j` `[..., D]`, float32,
    returned in the rows' dtype."""
    stacked = torch.stack(rows).float()  # [J, ..., D]
    keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    probs = torch.softmax(keys @ query.float().reshape(-1), dim=0)
    return (probs[..., None] * stacked).sum(0).to(rows[0].dtype)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, index: int, linear: LinearFactory):
        super().__init__()
        self.attention_type = config.attention_types[index]
        if self.attention_type == "kda":
            self.self_attn = K3DeltaAttention(config, linear)
        else:
            self.self_attn = K3MLAttention(config, linear)
        if config.ffn_types[index] == "moe":
            self.mlp = K3MoE(config, linear)
        else:
            self.mlp = K3MLP(config, config.hidden_size, config.intermediate_size, linear)
        self.input_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.self_attention_res_proj = K3ResidualQuery(config.hidden_size)
            self.self_attention_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_res_proj = K3ResidualQuery(config.hidden_size)
            self.mlp_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention(self, x: torch.Tensor, cache: K3Cache | None, index: int) -> torch.Tensor:
        """The attention sub-layer's output for its (pre-norm) input `x` `[B, T, D]`; updates `cache`."""
        return self.attend(self.input_layernorm(x), cache, index)

    def attend(self, h: torch.Tensor, cache: K3Cache | None, index: int) -> torch.Tensor:
        """`attention` given the already normalised input `h`."""
        if cache is None:
            return self.self_attn(h)[0] if self.attention_type == "kda" else self.self_attn(h)
        if self.attention_type == "kda":
            out, cache.layers[index] = self.self_attn(h, cache.layers[index])
            return out
        if cache.layers[index] is None:
            cache.layers[index] = PagedLatentCache(h.shape[0], self.self_attn.rank + self.self_attn.rope,
                                                   h.dtype, h.device, cache.page_size)
        return self.self_attn(h, cache.layers[index])

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))


class K3Model(nn.Module):
    """Embedding, decoder layers and the final norm; returns the final hidden states `[B, T, D]`."""

    def __init__(self, config: K3Config, linear: LinearFactory = dense_linear):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i, linear) for i in range(config.num_hidden_layers))
        self.norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.output_attn_res_proj = K3ResidualQuery(config.hidden_size)
            self.output_attn_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, cache: K3Cache | None = None,
                pending: bool = False) -> torch.Tensor | PendingNorm:
        """`inputs_embeds` `[B, T, D]` -> the final hidden states `[B, T, D]`; with `pending`, for a few tokens,
        the final norm may come back as a `PendingNorm` for the head's kernel to compute."""
        if not self.config.attn_res_block_size:
            out = self._residual_stream(inputs_embeds, cache)
            return out if pending else resolved(out)
        return self.norm(self._attn_res_stream(inputs_embeds, cache))

    def _residual_stream(self, embeds: torch.Tensor, cache: K3Cache | None) -> torch.Tensor | PendingNorm:
        """`h += attention(norm(h)); h += mlp(norm(h))` per layer, then the final norm; each residual add and the
        norm after it are one op, the rounding as in that order. For a few tokens (a decode step) that op is left
        to the kernel of the projection that reads it (`PendingNorm`); the MoE's router computes it itself."""
        defer = embeds.shape[0] * embeds.shape[1] <= MAX_ROWS

        def norm_after(h: torch.Tensor, delta: torch.Tensor | None, norm: K3RMSNorm) -> PendingNorm:
            pending = PendingNorm(h, delta, norm)
            if not defer:
                pending.value()
            return pending

        normed = norm_after(embeds, None, self.layers[0].input_layernorm)
        for index, layer in enumerate(self.layers):
            post = layer.post_attention_layernorm
            attended = layer.attend(normed if defer else normed.value(), cache, index)
            h = normed.total()
            if isinstance(layer.mlp, K3MoE):  # the add, the norm and the router: one kernel in decode steps
                h, out = layer.mlp.after_residual(h, attended, post)
            else:
                ffn_in = norm_after(h, attended, post)
                out = layer.mlp(ffn_in if defer else ffn_in.value())
                h = ffn_in.total()
            following = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else self.norm
            normed = norm_after(h, out, following)
        return normed if defer else normed.value()

    def _attn_res_stream(self, embeds: torch.Tensor, cache: K3Cache | None) -> torch.Tensor:
        """Block Attention Residuals. `bank` holds block snapshots; `prefix` is the sum of the sub-layer outputs
        since the current block began (the embedding at the start). Layer l's attention reads
        mix(bank + [prefix]); when l % block_size == 0 the prefix is then banked and restarted. The FFN reads
        mix(bank + [prefix + attention output]). The model's output reads mix(bank + [prefix])."""
        eps, block = self.config.rms_norm_eps, self.config.attn_res_block_size
        bank, prefix = [], embeds
        for index, layer in enumerate(self.layers):
            x = attn_res_mix(bank + [prefix], layer.self_attention_res_proj.weight,
                             layer.self_attention_res_norm.weight, eps)
            if index % block == 0:
                bank, prefix = bank + [prefix], None
            out = layer.attention(x, cache, index)
            prefix = out if prefix is None else prefix + out
            x = attn_res_mix(bank + [prefix], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
            prefix = prefix + layer.feed_forward(x)
        return attn_res_mix(bank + [prefix], self.output_attn_res_proj.weight, self.output_attn_res_norm.weight, eps)


class K3ForCausalLM(nn.Module):
    """The text model plus `lm_head`; with a `vision_config`, also the vision tower and projector whose outputs
    replace the embeddings at `<|media_pad|>` positions."""

    # Kept float32 whatever the working dtype (K3 stores and uses them so).
    keep_fp32_modules = ("A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "gate")

    def __init__(self, config: K3Config, linear: LinearFactory = dense_linear):
        super().__init__()
        self.config = config
        self.model = K3Model(config, linear)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.vision_config is not None:
            vision = K3VisionConfig.from_dict(config.vision_config, config.hidden_size)
            self.vision_tower = K3VisionTower(vision, linear)
            self.mm_projector = K3MultiModalProjector(vision, linear)

    @classmethod
    def from_pretrained(cls, folder, torch_dtype: torch.dtype = torch.bfloat16, device=None,
                        linear_factory: LinearFactory | None = None) -> "K3ForCausalLM":
        """Load a K3 or Kimi-Linear checkpoint folder (see `h3gen.pipelines.k3.loader`)."""
        return load_k3(cls, folder, torch_dtype=torch_dtype, device=device, linear_factory=linear_factory)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` `[B, T]` -> `[B, T, D]`: the embedding rows (a decode step's few ids by the kernel that lets
        the first projection start while it copies, `kernels.embedding`)."""
        table = self.model.embed_tokens
        if type(table) is nn.Embedding and table.padding_idx is None and table.max_norm is None:
            return embedding_rows(input_ids, table.weight)
        return table(input_ids)

    def encode_images(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """Vision tower + projector: `pixel_values` `[Np, 3, p, p]` and `grid_thws` `[n, 3]` (from
        `K3ImageProcessor`) -> `[sum of the images' token counts, D]`, images in order."""
        if not hasattr(self, "vision_tower"):
            raise ValueError("this checkpoint has no vision tower (no vision_config); images cannot be used.")
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def embed_multimodal(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, grid_thws=None,
                         image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings `[B, T, D]` with the image embeddings (given, or encoded from `pixel_values`) written
        over the `<|media_pad|>` positions, in order (row-major over the batch)."""
        embeds = self.embed(input_ids)
        if image_embeds is None and pixel_values is None:
            return embeds
        if image_embeds is None:
            image_embeds = self.encode_images(pixel_values, grid_thws)
        mask = input_ids == self.config.media_placeholder_token_id
        count = int(mask.sum())
        if count != image_embeds.shape[0]:
            raise ValueError(f"the prompt has {count} <|media_pad|> tokens but the images give {image_embeds.shape[0]} "
                             "embeddings (expand each image's placeholder to its token count).")
        embeds = embeds.clone()
        embeds[mask] = image_embeds.to(embeds.dtype)
        return embeds

    def forward(self, input_ids: torch.Tensor | None = None, cache: K3Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                grid_thws=None, with_argmax: bool = False,
                argmax_into: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` `[B, T]` (or `inputs_embeds` `[B, T, D]`) -> logits `[B, T, vocab]`. With `cache`, continues
        from the state it holds (prefill chunk or one-token decode) and leaves it updated. With `pixel_values` /
        `grid_thws` (see `encode_images`), the image embeddings replace the `<|media_pad|>` embeddings. With
        `with_argmax`, returns (logits, their argmax `[B, T]` int64: the greedy tokens, found by the head's kernel
        in a decode step); with `argmax_into` (contiguous int64, `B * T` of them) too, the argmax written there
        (a decode graph puts it where its next step reads its token ids)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_multimodal(input_ids, pixel_values, grid_thws)
        hidden = self.model(inputs_embeds, cache, pending=True)  # the final norm in the head's kernel
        if cache is not None:
            cache.seen_tokens += inputs_embeds.shape[1]
        if with_argmax or argmax_into is not None:
            return project_argmax(self.lm_head, hidden, argmax_into)
        return project(self.lm_head, hidden)

    def new_cache(self, page_size: int = 16) -> K3Cache:
        return K3Cache(self.config.num_hidden_layers, page_size)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, inputs_embeds: torch.Tensor | None = None,
                 eos_token_id: int | None = None, pixel_values: torch.Tensor | None = None,
                 grid_thws=None) -> torch.Tensor:
        """Greedy decoding: one prefill (images spliced in when given), then one token per step with the cache.
        Returns `[B, new]` token ids."""
        cache = self.new_cache()
        logits = self(input_ids, cache, inputs_embeds=inputs_embeds, pixel_values=pixel_values,
                      grid_thws=grid_thws)[:, -1]
        tokens = []
        for _ in range(max_new_tokens):
            token = logits.argmax(-1)
            tokens.append(token)
            if eos_token_id is not None and bool((token == eos_token_id).all()):
                break
            logits = self(token[:, None], cache)[:, -1]
        return torch.stack(tokens, dim=1)
