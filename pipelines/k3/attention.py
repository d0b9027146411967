"""The K3 model's two attention layers: Kimi Delta Attention (linear attention with a per-head recurrent state) and
gated multi-head latent attention (MLA) over a paged latent cache, each with its prefill and decode paths (the math
of the fast ops is in `h3gen.kernels.kda` and `h3gen.kernels.mla_decode`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.gemv import MAX_ROWS, grouped_rows_linear
from h3gen.kernels.kda import kda_chunked, kda_decode, kda_gate, l2_normalize, short_conv
from h3gen.kernels.mla_decode import absorb_output, absorb_query, mla_decode, mla_decode_partials, mla_decode_splits
from h3gen.linear import LinearFactory, LinearSpec
from h3gen.pipelines.k3.cache import KDAState, PagedLatentCache
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.layers import K3RMSNorm, K3ShortConv, fuse_linears, fused_outputs, project, stack_linears
from h3gen.pipelines.k3.pending_norm import PendingNorm, resolved


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

    def forward(self, x: torch.Tensor | PendingNorm, state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
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
        g = kda_gate(
            self.f_b_proj(self.f_a_proj(x)).view(shape), self.A_log, self.dt_bias, self.config.gate_lower_bound
        )
        beta = torch.sigmoid(self.b_proj(x).float())
        initial = None if state is None else state.recurrent
        o, recurrent = kda_chunked(q, k, v.float(), g, beta, self.head_dim**-0.5, initial)
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
        o = kda_decode(
            q,
            k,
            v,
            (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight),
            state.conv,
            f,
            self.A_log,
            self.dt_bias,
            self.config.gate_lower_bound,
            b,
            gate,
            self.o_norm.weight,
            self.o_norm.eps,
            state.recurrent,
            self.head_dim**-0.5,
            rows=state.rows,
            gate_up=gate_up,
        )
        return project(self.o_proj, o)[:, None]


class K3MLAttention(nn.Module):
    """Multi-head latent attention without rotary embedding (the `k_pe` part is still one shared head), with K3's
    optional sigmoid output gate. Prefill expands the latents per head; decode runs in the absorbed form against
    the paged latent cache (`h3gen.kernels.mla_decode`)."""

    def __init__(self, config: K3Config, linear: LinearFactory):
        super().__init__()
        d, n = config.hidden_size, config.num_attention_heads
        self.config, self.num_heads = config, n
        self.nope, self.rope, self.v_dim, self.rank = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        )
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
        self.scale = qk**-0.5
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
            q = project(
                self.q_b_proj, PendingNorm(q, None, self.q_a_layernorm) if b * t <= MAX_ROWS else self.q_a_layernorm(q)
            )
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
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal, scale=self.scale
        )
        return o.transpose(1, 2)

    def _decode_absorbed(
        self, q: torch.Tensor, cache: PagedLatentCache, gate: torch.Tensor | None = None, new_rows: tuple | None = None
    ) -> torch.Tensor:
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
        runs, lse = mla_decode_partials(
            query, cache.pages, cache.block_table(), cache.seq_lens(), self.scale, self.rank, splits
        )
        return absorb_output(runs, w_vc, q.dtype, gate, lse)

    def _absorbed_weights(self, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj`'s weight seen per head as `W_kc` `[n, d_n, r]` and `W_vc` `[n, d_v, r]` (views, no copy;
        the decode ops multiply in float32)."""
        w = self.kv_b_proj.weight.detach().view(heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]
