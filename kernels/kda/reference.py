"""Kimi Delta Attention in plain torch: the short causal conv, the decay gate, and the delta-rule recurrence in its
token-by-token (decode) and chunked (prefill) forms. Everything is computed in float32.

Shapes: `q`, `k` `[B, T, H, K]` (already L2-normalised), `v` `[B, T, H, V]`, `g` `[B, T, H, K]` (log decay per
channel, <= 0), `beta` `[B, T, H]` (after the sigmoid), state `[B, H, K, V]`. Per head and token:

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale * q_t)
"""

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None):
    """Depthwise causal conv + SiLU over time. `x` `[B, T, C]`, `weight` `[C, W]`, `state` `[B, W - 1, C]` (the last
    W - 1 raw inputs before `x`; None = zeros) -> (`[B, T, C]` in x.dtype, new state `[B, W - 1, C]` float32)."""
    width = weight.shape[-1]
    b, t, c = x.shape
    if state is None:
        state = x.new_zeros(b, width - 1, c, dtype=torch.float32)
    window = torch.cat([state.float(), x.float()], dim=1)  # [B, W - 1 + T, C]
    y = F.conv1d(window.transpose(1, 2), weight.float().unsqueeze(1), groups=c).transpose(1, 2)
    return F.silu(y).to(x.dtype), window[:, window.shape[1] - (width - 1) :].contiguous()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, float32 (fla's form: eps inside the root)."""
    x = x.float()
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None):
    """Log decay per channel from the gate projection `f` `[..., H, K]`, `a_log` `[H]`, `dt_bias` `[H * K]`.

    With `lower_bound` (K3's "safe gate"): `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`, in (lower_bound, 0).
    Without (Kimi-Linear): `-exp(A_log) * softplus(f + dt_bias)`."""
    heads, dim = f.shape[-2:]
    x = f.float() + dt_bias.float().view(heads, dim)
    rate = a_log.float().view(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def kda_recurrent(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None = None):
    """The recurrence one token at a time. Returns (`o` `[B, T, H, V]` in v.dtype, final state float32)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float().clone()
    out = q.new_empty(b, t, h, dv)
    for i in range(t):
        state = state * g[:, i, :, :, None].exp()
        k_i = k[:, i]
        delta = v[:, i] - torch.einsum("bhk,bhkv->bhv", k_i, state)
        state = state + torch.einsum("bhk,bhv->bhkv", k_i, beta[:, i, :, None] * delta)
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state)
    return out.to(v.dtype), state


def kda_chunked(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None = None, chunk_size: int = 64):
    """The same recurrence, `chunk_size` tokens at a time (WY form). Any length: the tail is padded with k = 0,
    beta = 0, g = 0, which leaves the state untouched. Returns (`o` `[B, T, H, V]` in v.dtype, final state float32).

    Per chunk, with Γ = cumsum(g) inside the chunk:
        A_kk[i, j] = beta_i Σ_c k_i[c] k_j[c] e^{Γ_i[c] - Γ_j[c]}  (j < i),   T = (I + A_kk)^-1 Diag(beta)
        w = T (e^Γ ⊙ k),  u = T v,  v' = u - w S
        o = (scale q ⊙ e^Γ) S + tril(A_qk) v',   A_qk[i, j] = Σ_c scale q_i[c] k_j[c] e^{Γ_i[c] - Γ_j[c]}
        S <- Diag(e^{Γ_last}) S + (e^{Γ_last - Γ} ⊙ k)^T v'
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dtype = v.dtype
    c = chunk_size
    if t == 0:
        state = q.new_zeros(b, h, dk, dv, dtype=torch.float32) if initial_state is None else initial_state.float()
        return v.new_empty(b, 0, h, dv), state
    pad = (-t) % c
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // c
    # [B, H, N, C, D]
    q, k, v, g = (x.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(b, n, c, h).permute(0, 3, 1, 2)
    q = q * scale
    gamma = g.cumsum(dim=-2)
    # Pairwise decays e^{Γ_i - Γ_j} for j <= i only (the other half would overflow), [B, H, N, C, C, K].
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = (gamma[..., :, None, :] - gamma[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    decay = diff.exp()
    a_kk = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", k, decay, k) * beta[..., :, None]
    a_kk = a_kk.tril(-1)  # strictly lower: j < i
    eye = torch.eye(c, device=q.device)
    t_mat = torch.linalg.solve_triangular(eye + a_kk, torch.diag_embed(beta), upper=False, unitriangular=True)
    w = t_mat @ (gamma.exp() * k)
    u = t_mat @ v
    a_qk = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", q, decay, k)  # causal (j <= i) through `decay`
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float().clone()
    out = q.new_empty(b, h, n, c, dv)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = (q[:, :, i] * gamma[:, :, i].exp()) @ state + a_qk[:, :, i] @ v_new
        last = gamma[:, :, i, -1]  # [B, H, K]
        k_decayed = (last[:, :, None, :] - gamma[:, :, i]).exp() * k[:, :, i]
        state = state * last.exp()[..., None] + k_decayed.transpose(-1, -2) @ v_new
    out = out.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]
    return out.to(dtype), state


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    conv_weights,
    conv_state: torch.Tensor,
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    b: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    state: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    gate_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token of a KDA layer after its projections, updating `conv_state` and `state` in place.

    Args:
        q, k, v: `[B, H * D]` raw projections (model dtype).
        conv_weights: (q, k, v) depthwise conv taps, each `[H * D, W]`.
        conv_state: `[B, W - 1, 3 * H * D]` float32, the last raw `[q|k|v]` inputs.
        f: `[B, H * D]` gate projection (after `f_b_proj`); `a_log` `[H]`, `dt_bias` `[H * D]`.
        b: `[B, H]` beta logits. gate: `[B, H * D]` output-gate logits.
        norm_weight: `[D]` the output RMSNorm weight; state: `[B, H, D, D]` float32.
        rows: optional `[B]` indices: then `conv_state` and `state` hold more rows, sequence b's being `rows[b]`.
        gate_up: optional `[2, H * D, R]` (`f_b_proj`'s and `g_b_proj`'s weights stacked, model dtype): then `f` and
            `gate` are the low-rank gate inputs `[B, R]` (`f_a_proj`'s and `g_a_proj`'s outputs), projected up
            here (each rounded to the model dtype, as the linears would).
    Returns:
        `[B, H * D]` in q.dtype: RMSNorm(o) * sigmoid(gate) with o the recurrence's output.
    """
    if gate_up is not None:
        f, gate = F.linear(f, gate_up[0]), F.linear(gate, gate_up[1])
    if rows is not None:
        conv_rows, state_rows = conv_state[rows], state[rows]
        out = kda_decode(
            q,
            k,
            v,
            conv_weights,
            conv_rows,
            f,
            a_log,
            dt_bias,
            lower_bound,
            b,
            gate,
            norm_weight,
            norm_eps,
            state_rows,
            scale,
        )
        conv_state.index_copy_(0, rows, conv_rows)
        state.index_copy_(0, rows, state_rows)
        return out
    batch, heads, dim = state.shape[0], state.shape[1], state.shape[2]
    shape = (batch, 1, heads, dim)
    weight = torch.cat([w.reshape(w.shape[0], -1) for w in conv_weights])  # [3 * H * D, W]
    qkv, new_conv = short_conv(torch.cat([q, k, v], dim=-1)[:, None], weight, conv_state)
    conv_state.copy_(new_conv)
    qc, kc, vc = qkv.split(heads * dim, dim=-1)
    g = kda_gate(f.view(shape), a_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())[:, None]
    o, new_state = kda_recurrent(
        l2_normalize(qc.reshape(shape)),
        l2_normalize(kc.reshape(shape)),
        vc.reshape(shape).float(),
        g,
        beta,
        scale,
        state,
    )
    state.copy_(new_state)
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    return (of * torch.sigmoid(gate.float().view(shape))).to(q.dtype).reshape(batch, heads * dim)
