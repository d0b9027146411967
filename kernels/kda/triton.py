"""KDA decode in one Triton kernel: per (sequence, head, part of the value columns) program, the short conv + SiLU
of its q/k/v channels, the L2 norms, the decay gate and beta, the delta-rule update of its columns of the `[D, D]`
state (in place) and, once every part of the head is done, the output RMSNorm times the sigmoid gate. Replaces
some forty small kernels of the torch path per layer and step.

The state's value columns are independent (column j of the state only meets column j of v and of the output), so
a head splits over `parts` programs: a decode step at batch 1 has a few dozen heads, too few programs to stream
the states at the GPU's bandwidth. The output RMSNorm needs the whole head, so each part stores its columns of the
raw output and counts itself in; the last part of the head normalises them (and shifts the head's q/k conv
state, which every part reads, from the values it read itself: no second read).

With low-rank gates (`gate_up`) the two up-projections happen here too: each program multiplies the decay gate's
rows for its head and the output gate's rows for its columns (loaded before the PDL wait) by the low-rank inputs,
so a decode step has no GEMV kernel for them."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._arrivals import arrival_counters
from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _tap(state_ptr, channel, mask, stride_tap, tap: tl.constexpr, WIDTH: tl.constexpr):
    """The conv state's earlier raw input number `tap` (zeros for a tap the conv does not have)."""
    if tap < WIDTH - 1:
        return tl.load(state_ptr + tap * stride_tap + channel, mask=mask, other=0.0)
    return tl.zeros(channel.shape, tl.float32)


@triton.jit
def _conv_weights(w_ptr, local, mask, WIDTH: tl.constexpr):
    """The conv weights of channels `local` (float32), taps oldest first; zeros for taps the conv does not have.
    Weights: loaded before the PDL wait."""
    w0 = tl.load(w_ptr + local * WIDTH, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.zeros(local.shape, tl.float32)
    w2 = tl.zeros(local.shape, tl.float32)
    if WIDTH > 2:
        w1 = tl.load(w_ptr + local * WIDTH + 1, mask=mask, other=0.0).to(tl.float32)
    if WIDTH > 3:
        w2 = tl.load(w_ptr + local * WIDTH + 2, mask=mask, other=0.0).to(tl.float32)
    last = tl.load(w_ptr + local * WIDTH + (WIDTH - 1), mask=mask, other=0.0).to(tl.float32)
    return w0, w1, w2, last


@triton.jit
def _conv_silu(x, t0, t1, t2, w0, w1, w2, last, WIDTH: tl.constexpr):
    """Causal depthwise conv of one token's raw input `x` (float32) over `WIDTH` <= 4 taps (`t0`.. the state's
    `WIDTH - 1` earlier raw inputs, oldest first, from `_tap`; weights from `_conv_weights`), then SiLU."""
    acc = x * last
    acc += t0 * w0
    if WIDTH > 2:
        acc += t1 * w1
    if WIDTH > 3:
        acc += t2 * w2
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_shift(x, t1, t2, state_ptr, channel, mask, stride_tap, WIDTH: tl.constexpr):
    """Shift the raw input `x` into the conv state from the earlier inputs `_conv_silu` read (`state[tap] =
    earlier[tap + 1]`, the last tap = x), with no second read. The caller makes sure that every reader of these
    taps (every thread of the program, every part of the head) has read them before."""
    if WIDTH > 2:
        tl.store(state_ptr + channel, t1, mask=mask)
    if WIDTH > 3:
        tl.store(state_ptr + stride_tap + channel, t2, mask=mask)
    tl.store(state_ptr + (WIDTH - 2) * stride_tap + channel, x, mask=mask)


@triton.jit
def _norm_gate_store(o, gate, norm_w, mask, dim, out_ptr, norm_eps, out_dtype):
    """The head's output RMSNorm over its `dim` values (weights `norm_w`, float32, loaded early) times the sigmoid
    of its gate logits (float32), stored."""
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / dim + norm_eps) * norm_w
    tl.store(out_ptr, (o * tl.sigmoid(gate)).to(out_dtype), mask=mask)


@triton.jit
def _up_project(w, x, dtype):
    """A low-rank gate's up-projection: `w` `[C, R]` times the `[R]` input `x` (both loaded), float32 sums
    rounded to `dtype` (as the linear's output would be). (As a `tl.dot` through shared memory the b=1 decode step
    was 10 % slower on the H200: 0.836 ms against 0.762.)"""
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1).to(dtype).to(tl.float32)


@triton.jit
def _kda_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    wq_ptr,
    wk_ptr,
    wv_ptr,
    conv_ptr,
    f_ptr,
    alog_ptr,
    dtb_ptr,
    b_ptr,
    gate_ptr,
    up_ptr,
    normw_ptr,
    state_ptr,
    rows_ptr,
    out_ptr,
    raw_ptr,
    count_ptr,
    heads,
    dim,
    rank,
    stride_row,
    stride_f,
    stride_gate,
    stride_up_g,
    stride_up_n,
    stride_conv_b,
    stride_conv_tap,
    stride_sb,
    stride_sh,
    scale,
    lower_bound,
    norm_eps,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
    WIDTH: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    ROWS: tl.constexpr,
    LOWRANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = tl.program_id(2)
    cols = tl.arange(0, BLOCK)  # the key channels (all of them)
    mask = cols < dim
    part_cols = part * (BLOCK // PARTS) + tl.arange(0, BLOCK // PARTS)  # this program's value columns
    part_mask = part_cols < dim
    local = head * dim + cols  # this head's channels within q (and k, v)
    part_local = head * dim + part_cols
    # Weights (and, with several parts, this part's state columns) load before the PDL wait; everything the
    # projection before wrote loads in one round after it.
    if LOWRANK:  # the gates' up-projection weights (the head's decay rows, the part's output-gate rows)
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        w_decay = tl.load(
            up_ptr + local[:, None] * stride_up_n + ranks[None, :], mask=mask[:, None] & rank_ok[None, :], other=0.0
        )
        w_gate = tl.load(
            up_ptr + stride_up_g + part_local[:, None] * stride_up_n + ranks[None, :],
            mask=part_mask[:, None] & rank_ok[None, :],
            other=0.0,
        )
    qw0, qw1, qw2, qw3 = _conv_weights(wq_ptr, local, mask, WIDTH)
    kw0, kw1, kw2, kw3 = _conv_weights(wk_ptr, local, mask, WIDTH)
    vw0, vw1, vw2, vw3 = _conv_weights(wv_ptr, part_local, part_mask, WIDTH)
    dt_bias = tl.load(dtb_ptr + local, mask=mask, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(alog_ptr + head).to(tl.float32))
    norm_w = tl.load(normw_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # read at the end, after reductions
    if PARTS > 1:
        # A part's state columns are few enough to hold while waiting: they load as the projection drains (the
        # states and rows are written a step earlier, never by the kernel just before).
        slot = seq
        if ROWS:
            slot = tl.load(rows_ptr + seq).to(tl.int64)
        tile = state_ptr + slot * stride_sb + head * stride_sh + cols[:, None] * dim + part_cols[None, :]
        both = mask[:, None] & part_mask[None, :]
        state = tl.load(tile, mask=both, other=0.0)
        wait_for_inputs(PDL)
    else:
        wait_for_inputs(PDL)
        slot = seq  # the sequence's row of the states
        if ROWS:
            slot = tl.load(rows_ptr + seq).to(tl.int64)
    width = heads * dim
    row = seq * stride_row
    conv = conv_ptr + slot * stride_conv_b
    out_dtype = q_ptr.dtype.element_ty
    q_raw = tl.load(q_ptr + row + local, mask=mask, other=0.0).to(tl.float32)
    k_raw = tl.load(k_ptr + row + local, mask=mask, other=0.0).to(tl.float32)
    v_raw = tl.load(v_ptr + row + part_local, mask=part_mask, other=0.0).to(tl.float32)
    q0 = _tap(conv, local, mask, stride_conv_tap, 0, WIDTH)
    q1 = _tap(conv, local, mask, stride_conv_tap, 1, WIDTH)
    q2 = _tap(conv, local, mask, stride_conv_tap, 2, WIDTH)
    k0 = _tap(conv, width + local, mask, stride_conv_tap, 0, WIDTH)
    k1 = _tap(conv, width + local, mask, stride_conv_tap, 1, WIDTH)
    k2 = _tap(conv, width + local, mask, stride_conv_tap, 2, WIDTH)
    v0 = _tap(conv, 2 * width + part_local, part_mask, stride_conv_tap, 0, WIDTH)
    v1 = _tap(conv, 2 * width + part_local, part_mask, stride_conv_tap, 1, WIDTH)
    v2 = _tap(conv, 2 * width + part_local, part_mask, stride_conv_tap, 2, WIDTH)
    if LOWRANK:
        f_in = tl.load(f_ptr + seq * stride_f + ranks, mask=rank_ok, other=0.0)
        gate_in = tl.load(gate_ptr + seq * stride_gate + ranks, mask=rank_ok, other=0.0)
    else:
        f = tl.load(f_ptr + seq * stride_f + local, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + seq * stride_gate + part_local, mask=part_mask, other=0.0).to(tl.float32)
    beta = tl.sigmoid(tl.load(b_ptr + seq * heads + head).to(tl.float32))
    q = _conv_silu(q_raw, q0, q1, q2, qw0, qw1, qw2, qw3, WIDTH)
    k = _conv_silu(k_raw, k0, k1, k2, kw0, kw1, kw2, kw3, WIDTH)
    v = _conv_silu(v_raw, v0, v1, v2, vw0, vw1, vw2, vw3, WIDTH)
    # No other program reads this part's v taps (nor, with one part, the head's q/k taps): shift them now, which
    # frees their registers; the head's last part shifts the q/k taps when there are several.
    tl.debug_barrier()  # every thread has read the taps it overwrites
    _conv_shift(v_raw, v1, v2, conv, 2 * width + part_local, part_mask, stride_conv_tap, WIDTH)
    if PARTS == 1:
        _conv_shift(q_raw, q1, q2, conv, local, mask, stride_conv_tap, WIDTH)
        _conv_shift(k_raw, k1, k2, conv, width + local, mask, stride_conv_tap, WIDTH)
    q = q.to(out_dtype).to(tl.float32)  # the conv output is rounded to the model dtype, as in the torch path
    k = k.to(out_dtype).to(tl.float32)
    v = v.to(out_dtype).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    # Decay gate (log space) and output gate logits.
    if LOWRANK:
        f = _up_project(w_decay, f_in, f_ptr.dtype.element_ty)
        gate = _up_project(w_gate, gate_in, gate_ptr.dtype.element_ty)
    x = f + dt_bias
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    # The state's columns [D (k), D / PARTS (v)] of this sequence, head and part.
    if PARTS == 1:
        tile = state_ptr + slot * stride_sb + head * stride_sh + cols[:, None] * dim + part_cols[None, :]
        both = mask[:, None] & part_mask[None, :]
        state = tl.load(tile, mask=both, other=0.0)
    state = state * tl.exp(g)[:, None]
    # Every thread holds its copy of the old state and of the conv taps before any writes the new ones.
    tl.debug_barrier()
    delta = v - tl.sum(k[:, None] * state, axis=0)
    state = state + k[:, None] * (beta * delta)[None, :]
    o = tl.sum((q * scale)[:, None] * state, axis=0)
    tl.store(tile, state, mask=both)
    if PARTS == 1:
        _norm_gate_store(o, gate, norm_w, mask, dim, out_ptr + seq * width + local, norm_eps, out_dtype)
    else:
        # The raw output and (with low-rank gates, computed here per part) the gate logits go to a float32 scratch
        # row `[o | gate]`; the head's last part reads them all.
        tl.store(raw_ptr + seq * 2 * width + part_local, o, mask=part_mask)
        if LOWRANK:
            tl.store(raw_ptr + seq * 2 * width + width + part_local, gate, mask=part_mask)
        # Every thread's stores (and reads of the q/k conv state) come before the count, released by its atomic.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + seq * heads + head, 1, sem="acq_rel", scope="gpu")
        if done == PARTS - 1:  # the head's last part: every other part has read the q/k taps and stored its columns
            _conv_shift(q_raw, q1, q2, conv, local, mask, stride_conv_tap, WIDTH)
            _conv_shift(k_raw, k1, k2, conv, width + local, mask, stride_conv_tap, WIDTH)
            o_all = tl.load(raw_ptr + seq * 2 * width + local, mask=mask, other=0.0, cache_modifier=".cg")
            if LOWRANK:
                gate_all = tl.load(
                    raw_ptr + seq * 2 * width + width + local, mask=mask, other=0.0, cache_modifier=".cg"
                )
            else:
                gate_all = tl.load(gate_ptr + seq * stride_gate + local, mask=mask, other=0.0).to(tl.float32)
            _norm_gate_store(o_all, gate_all, norm_w, mask, dim, out_ptr + seq * width + local, norm_eps, out_dtype)
            tl.store(count_ptr + seq * heads + head, 0)  # ready for the next step (and graph replay)


def default_parts(batch: int, heads: int, dim: int) -> int:
    """Value-column parts per head: 8 up to 16 (sequence, head) pairs, 4 up to 32, 2 up to 64, else 1, never parts
    under 16 columns (H200, 16 heads x 128: 4.8 us for 4 parts against 5.6 for 1 at batch 1 and 2, one part the
    fastest from batch 8; the whole b=1 step, with the gates projected here, 0.753 ms at 8 parts against 0.762 at
    4)."""
    pairs = batch * heads
    parts = 8 if pairs <= 16 else 4 if pairs <= 32 else 2 if pairs <= 64 else 1
    while parts > 1 and next_power_of_2(dim) // parts < 16:
        parts //= 2
    return parts


def kda_decode(
    q,
    k,
    v,
    conv_weights,
    conv_state,
    f,
    a_log,
    dt_bias,
    lower_bound,
    b,
    gate,
    norm_weight,
    norm_eps,
    state,
    scale,
    rows=None,
    gate_up=None,
    num_warps=None,
    parts=None,
):
    """See `reference.kda_decode` (same arguments; `conv_state` and `state` are updated in place). `q`, `k`, `v`
    may be column slices of one tensor (the fused projection); `state`'s `[D, D]` and `conv_state`'s channel axis
    must be contiguous; with `rows` `[B]` they hold more rows and sequence b's is `rows[b]`. With `gate_up`
    `[2, H * D, R]`, `f` and `gate` are the low-rank gate inputs `[B, R]` and each program projects up the rows it
    needs (weights loaded before the PDL wait: no GEMV kernel of their own). With PDL, `state` and `rows` must not
    be written by the kernel just before (they load while it drains). `parts` (a power of two) splits each head's
    value columns over that many programs (`default_parts`); `num_warps` tunes the launch."""
    batch, heads, dim = q.shape[0], state.shape[1], state.shape[2]
    width = conv_weights[0].shape[-1]
    if len({t.stride(0) for t in (q, k, v)}) != 1 or any(t.stride(-1) != 1 for t in (q, k, v)):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    f, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (f, gate))
    if state.stride(3) != 1 or state.stride(2) != dim or conv_state.stride(2) != 1:
        raise ValueError("kda_decode needs the state's [D, D] and the conv state's channels contiguous.")
    if not 2 <= width <= 4:
        raise ValueError(f"kda_decode's kernel takes convs of 2 to 4 taps (got {width}).")
    rank = 1
    if gate_up is not None:
        rank = gate_up.shape[2]
        if (
            gate_up.shape[:2] != (2, heads * dim)
            or gate_up.stride(2) != 1
            or f.shape != (batch, rank)
            or gate.shape != (batch, rank)
        ):
            raise ValueError(
                f"kda_decode's gate_up must be [2, {heads * dim}, R] with unit inner stride and f, gate "
                f"the [B, R] low-rank inputs (got {tuple(gate_up.shape)}, {tuple(f.shape)}, "
                f"{tuple(gate.shape)})."
            )
    block = next_power_of_2(dim)
    parts = parts or default_parts(batch, heads, dim)
    if parts & (parts - 1) or not 1 <= parts <= block:
        raise ValueError(f"kda_decode's parts must be a power of two up to {block} (got {parts}).")
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    raw = torch.empty(batch, 2 * heads * dim, dtype=torch.float32, device=q.device) if parts > 1 else out
    counts = arrival_counters(q.device, "kda_decode", batch * heads) if parts > 1 else out
    pdl = pdl_launch(q)
    up = gate_up if gate_up is not None else f
    _kda_decode_kernel[(batch, heads, parts)](
        q,
        k,
        v,
        *(w.reshape(heads * dim, width) for w in conv_weights),
        conv_state,
        f,
        a_log,
        dt_bias,
        b.contiguous(),
        gate,
        up,
        norm_weight,
        state,
        rows if rows is not None else b,
        out,
        raw,
        counts,
        heads,
        dim,
        rank,
        q.stride(0),
        f.stride(0),
        gate.stride(0),
        up.stride(0),
        up.stride(1) if up.dim() > 2 else 0,
        conv_state.stride(0),
        conv_state.stride(1),
        state.stride(0),
        state.stride(1),
        scale,
        0.0 if lower_bound is None else float(lower_bound),
        norm_eps,
        BLOCK=block,
        PARTS=parts,
        WIDTH=width,
        SAFE_GATE=lower_bound is not None,
        ROWS=rows is not None,
        LOWRANK=gate_up is not None,
        BLOCK_R=next_power_of_2(rank),
        PDL=pdl_flag(pdl),
        num_warps=num_warps or 4,
        **pdl,
    )  # 4 warps: 5.9 us at 16 heads x 128 on the H200, 8 warps 13.7 us
    return out
