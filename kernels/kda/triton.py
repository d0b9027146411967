"""KDA decode in one Triton kernel: per (sequence, head) program, the short conv + SiLU of its q/k/v channels, the
L2 norms, the decay gate and beta, the delta-rule update of its `[D, D]` state (in place) and the output RMSNorm
times the sigmoid gate. Replaces some forty small kernels of the torch path per layer and step."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2
from h3gen.kernels._pdl import pdl_flag, pdl_launch, wait_for_inputs


@triton.jit
def _conv_silu(x_ptr, w_ptr, state_ptr, channel, local, mask, stride_tap, WIDTH: tl.constexpr):
    """Causal depthwise conv of one token over `WIDTH` taps (the state holds the `WIDTH - 1` earlier raw inputs),
    then SiLU; shifts the new input into the state. Returns float32.

    A vector shorter than the program's threads is held by several threads, which do not run in lockstep: every
    rewrite of state memory waits at a barrier until all threads have read what it overwrites."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + local * WIDTH + (WIDTH - 1), mask=mask, other=0.0).to(tl.float32)
    for tap in tl.static_range(WIDTH - 1):
        earlier = tl.load(state_ptr + tap * stride_tap + channel, mask=mask, other=0.0)
        acc += earlier * tl.load(w_ptr + local * WIDTH + tap, mask=mask, other=0.0).to(tl.float32)
    for tap in tl.static_range(WIDTH - 2):  # shift: state[tap] = state[tap + 1]
        later = tl.load(state_ptr + (tap + 1) * stride_tap + channel, mask=mask, other=0.0)
        tl.debug_barrier()
        tl.store(state_ptr + tap * stride_tap + channel, later, mask=mask)
    tl.debug_barrier()
    tl.store(state_ptr + (WIDTH - 2) * stride_tap + channel, x, mask=mask)
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, wv_ptr, conv_ptr, f_ptr, alog_ptr, dtb_ptr, b_ptr,
                       gate_ptr, normw_ptr, state_ptr, rows_ptr, out_ptr, heads, dim, stride_row, stride_f, stride_gate,
                       stride_conv_b, stride_conv_tap, stride_sb, stride_sh, scale, lower_bound, norm_eps,
                       BLOCK: tl.constexpr, WIDTH: tl.constexpr, SAFE_GATE: tl.constexpr, ROWS: tl.constexpr,
                       PDL: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    wait_for_inputs(PDL)
    slot = seq  # the sequence's row of the states
    if ROWS:
        slot = tl.load(rows_ptr + seq).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    local = head * dim + cols  # this head's channels within q (and k, v)
    width = heads * dim
    row = seq * stride_row
    conv = conv_ptr + slot * stride_conv_b
    out_dtype = q_ptr.dtype.element_ty
    q = _conv_silu(q_ptr + row + local, wq_ptr, conv, local, local, mask, stride_conv_tap, WIDTH)
    k = _conv_silu(k_ptr + row + local, wk_ptr, conv, width + local, local, mask, stride_conv_tap, WIDTH)
    v = _conv_silu(v_ptr + row + local, wv_ptr, conv, 2 * width + local, local, mask, stride_conv_tap, WIDTH)
    q = q.to(out_dtype).to(tl.float32)  # the conv output is rounded to the model dtype, as in the torch path
    k = k.to(out_dtype).to(tl.float32)
    v = v.to(out_dtype).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    # Decay gate (log space) and beta.
    x = tl.load(f_ptr + seq * stride_f + local, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(dtb_ptr + local, mask=mask, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(alog_ptr + head).to(tl.float32))
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    beta = tl.sigmoid(tl.load(b_ptr + seq * heads + head).to(tl.float32))
    # The state [D (k), D (v)] of this sequence and head.
    tile = state_ptr + slot * stride_sb + head * stride_sh + cols[:, None] * dim + cols[None, :]
    both = mask[:, None] & mask[None, :]
    state = tl.load(tile, mask=both, other=0.0) * tl.exp(g)[:, None]
    tl.debug_barrier()  # every thread holds its copy of the old state before any writes the new one
    delta = v - tl.sum(k[:, None] * state, axis=0)
    state = state + k[:, None] * (beta * delta)[None, :]
    o = tl.sum((q * scale)[:, None] * state, axis=0)
    tl.store(tile, state, mask=both)
    # Output RMSNorm over the head's values, times the sigmoid gate.
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / dim + norm_eps) * tl.load(normw_ptr + cols, mask=mask, other=0.0).to(
        tl.float32)
    gate = tl.load(gate_ptr + seq * stride_gate + local, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + seq * width + local, (o * tl.sigmoid(gate)).to(out_dtype), mask=mask)


def kda_decode(q, k, v, conv_weights, conv_state, f, a_log, dt_bias, lower_bound, b, gate, norm_weight, norm_eps,
               state, scale, rows=None, num_warps=None):
    """See `reference.kda_decode` (same arguments; `conv_state` and `state` are updated in place). `q`, `k`, `v`
    may be column slices of one tensor (the fused projection); `state`'s `[D, D]` and `conv_state`'s channel axis
    must be contiguous; with `rows` `[B]` they hold more rows and sequence b's is `rows[b]`. `num_warps` tunes the
    launch (one program per sequence and head)."""
    batch, heads, dim = q.shape[0], state.shape[1], state.shape[2]
    width = conv_weights[0].shape[-1]
    if len({t.stride(0) for t in (q, k, v)}) != 1 or any(t.stride(-1) != 1 for t in (q, k, v)):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    f, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (f, gate))
    if state.stride(3) != 1 or state.stride(2) != dim or conv_state.stride(2) != 1:
        raise ValueError("kda_decode needs the state's [D, D] and the conv state's channels contiguous.")
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    pdl = pdl_launch(q)
    _kda_decode_kernel[(batch, heads)](
        q, k, v, *(w.reshape(heads * dim, width) for w in conv_weights), conv_state, f, a_log, dt_bias,
        b.contiguous(), gate, norm_weight, state, rows if rows is not None else b, out, heads, dim, q.stride(0),
        f.stride(0), gate.stride(0),
        conv_state.stride(0), conv_state.stride(1), state.stride(0), state.stride(1), scale,
        0.0 if lower_bound is None else float(lower_bound), norm_eps,
        BLOCK=next_power_of_2(dim), WIDTH=width, SAFE_GATE=lower_bound is not None, ROWS=rows is not None,
        PDL=pdl_flag(pdl),
        num_warps=num_warps or 4, **pdl)  # 4 warps: 5.9 us at 16 heads x 128 on the H200, 8 warps 13.7 us (RESULTS.md)
    return out
