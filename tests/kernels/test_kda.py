"""KDA (Kimi delta attention): the torch references against fla-core's naive functions and transformers'
short convolution, the fused Triton decode step against the reference."""

import pytest
import torch
import torch.nn.functional as F
from helpers.k3_reference import fla_gate, fla_naive, kimi_linear_torch, max_rel_error
from helpers.kernel_cases import DEVICE
from helpers.kernel_cases import err as _err

from h3gen.kernels.kda import kda_chunked, kda_gate, kda_recurrent, short_conv


def _kda_inputs(b, t, h, dk, dv, seed, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = lower_bound * torch.sigmoid(torch.randn(b, t, h, dk, generator=gen))
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("b,t,h,dk,dv", [(1, 1, 1, 8, 8), (2, 37, 3, 16, 12), (1, 130, 2, 32, 16)])
def test_kda_recurrent_matches_fla_naive_recurrent(b, t, h, dk, dv):
    q, k, v, g, beta, state = _kda_inputs(b, t, h, dk, dv, seed=t)
    ref_o, ref_s = fla_naive().naive_recurrent_kda(
        q, k, v, g, beta, scale=dk**-0.5, initial_state=state, output_final_state=True
    )
    o, s = kda_recurrent(q, k, v, g, beta, dk**-0.5, state)
    assert max_rel_error(o, ref_o) < 1e-5 and max_rel_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("b,t,h,dk,dv,chunk", [(2, 64, 2, 16, 16, 64), (1, 128, 3, 8, 24, 64), (2, 48, 1, 16, 8, 16)])
def test_kda_chunked_matches_fla_naive_chunk(b, t, h, dk, dv, chunk):
    q, k, v, g, beta, state = _kda_inputs(b, t, h, dk, dv, seed=t + 1)
    ref_o, ref_s = fla_naive().naive_chunk_kda(
        q, k, v, g, beta, scale=dk**-0.5, initial_state=state, output_final_state=True, chunk_size=chunk
    )
    o, s = kda_chunked(q, k, v, g, beta, dk**-0.5, state, chunk_size=chunk)
    assert max_rel_error(o, ref_o) < 1e-5 and max_rel_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("t,split", [(1, 0), (37, 20), (99, 64), (70, 3)])
def test_kda_chunked_odd_lengths_and_carried_state_match_fla_recurrent(t, split):
    # Odd lengths (the chunked form pads the tail) and the state handed from one call to the next.
    q, k, v, g, beta, state = _kda_inputs(2, t, 2, 16, 12, seed=t + split)
    ref_o, ref_s = fla_naive().naive_recurrent_kda(
        q, k, v, g, beta, scale=0.25, initial_state=state, output_final_state=True
    )
    first = kda_chunked(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split], 0.25, state)
    second = kda_chunked(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:], 0.25, first[1])
    assert max_rel_error(torch.cat([first[0], second[0]], dim=1), ref_o) < 1e-5
    assert max_rel_error(second[1], ref_s) < 1e-5


def test_kda_long_chunk_with_strong_decay_stays_finite():
    # Cumulative log decay reaches -5 * 64 = -320 inside a chunk: e^-320 underflows float32, the result must not.
    q, k, v, g, beta, _ = _kda_inputs(1, 128, 2, 16, 16, seed=3, lower_bound=-5.0)
    g = torch.full_like(g, -4.99)
    ref_o, ref_s = fla_naive().naive_recurrent_kda(q, k, v, g, beta, scale=0.25, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, beta, 0.25)
    assert torch.isfinite(o).all() and max_rel_error(o, ref_o) < 1e-5 and max_rel_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_matches_fla(lower_bound):
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(2, 7, 3, 16, generator=gen) * 3
    a_log = torch.empty(3).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(48, generator=gen)
    if lower_bound is None:
        ref = fla_gate().naive_kda_gate(f, a_log, dt_bias)
    else:
        ref = fla_gate().naive_kda_lowerbound_gate(f, a_log, dt_bias, lower_bound=lower_bound)
    assert max_rel_error(kda_gate(f, a_log, dt_bias, lower_bound), ref) < 1e-6


def test_short_conv_matches_transformers_and_carries_state():
    modeling = kimi_linear_torch()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 10, generator=gen)
    weight = torch.randn(10, 4, generator=gen)
    ref = modeling.causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    whole, _ = short_conv(x, weight)
    assert max_rel_error(whole, ref) < 1e-6
    first, state = short_conv(x[:, :2], weight)  # shorter than the window
    second, state = short_conv(x[:, 2:9], weight, state)
    parts = [first, second]
    for i in range(9, 13):  # one token at a time, as in decode
        out, state = short_conv(x[:, i : i + 1], weight, state)
        parts.append(out)
    assert max_rel_error(torch.cat(parts, dim=1), ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,dim,width,lower_bound,parts",
    [
        (3, 16, 4, None, 1),
        (2, 32, 3, -5.0, 4),
        (5, 8, 4, -5.0, None),
        (2, 24, 4, None, 4),
        pytest.param(3, 16, 4, None, 16, marks=pytest.mark.slow),  # 16 parts in the interpreter: 8 s each dtype
    ],
)
def test_fused_kda_decode_matches_reference(heads, dim, width, lower_bound, dtype, parts):
    from h3gen.kernels.kda import reference as kda_ref
    from h3gen.kernels.kda import triton as kda_triton

    g = torch.Generator(device=DEVICE).manual_seed(heads * dim + width)
    batch, hd = 2, heads * dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)

    # q, k, v, b as column slices of one fused projection (as the model passes them), f and gate on their own.
    fused = rand(batch, 3 * hd + heads + 5)
    q, k, v, b = fused[:, :hd], fused[:, hd : 2 * hd], fused[:, 2 * hd : 3 * hd], fused[:, 3 * hd : 3 * hd + heads]
    f, gate = rand(batch, hd), rand(batch, hd)
    conv_weights = [torch.randn(hd, 1, width, generator=g, device=DEVICE) * 0.5 for _ in range(3)]
    a_log = torch.rand(heads, generator=g, device=DEVICE) * 2.0
    dt_bias = torch.randn(hd, generator=g, device=DEVICE) * 0.5
    norm_weight = (1.0 + 0.1 * torch.randn(dim, generator=g, device=DEVICE)).to(dtype)
    # States as the pool holds them: views into per-sequence rows that hold other layers' states too.
    rows = torch.randn(batch, 3, (width - 1) * 3 * hd + heads * dim * dim, generator=g, device=DEVICE)
    conv_state = rows[:, 1, : (width - 1) * 3 * hd].view(batch, width - 1, 3 * hd)
    state = rows[:, 1, (width - 1) * 3 * hd :].view(batch, heads, dim, dim)
    expected_conv, expected_state = conv_state.clone(), state.clone()
    start = rows.clone()
    args = (f, a_log, dt_bias, lower_bound, b, gate, norm_weight, 1e-5)
    expected = kda_ref.kda_decode(q, k, v, conv_weights, expected_conv, *args, expected_state, dim**-0.5)
    untouched = rows[:, 0].clone()
    got = kda_triton.kda_decode(q, k, v, conv_weights, conv_state, *args, state, dim**-0.5, parts=parts)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert got.shape == (batch, hd) and got.dtype == dtype
    assert _err(got, expected) <= tolerance
    assert _err(state, expected_state) <= 1e-5 and torch.equal(conv_state, expected_conv)
    assert torch.equal(rows[:, 0], untouched)  # the neighbouring layer's state is left alone
    # The states where they lie in a pool of five slots, picked by row indices (a decode graph's layout).
    pool = torch.randn(5, 3, rows.shape[-1], generator=g, device=DEVICE)
    picked = torch.tensor([3, 0], device=DEVICE)
    pool[picked, 1] = start[:, 1]
    pool_conv = pool[:, 1, : (width - 1) * 3 * hd].view(5, width - 1, 3 * hd)
    pool_state = pool[:, 1, (width - 1) * 3 * hd :].view(5, heads, dim, dim)
    before = pool.clone()
    got = kda_triton.kda_decode(
        q, k, v, conv_weights, pool_conv, *args, pool_state, dim**-0.5, rows=picked, parts=parts
    )
    assert _err(got, expected) <= tolerance
    assert _err(pool_state[picked], expected_state) <= 1e-5 and torch.equal(pool_conv[picked], expected_conv)
    others = [1, 2, 4]
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, 0], before[:, 0])
    via_ref = before.clone()  # the reference with rows gathers, computes and writes back the same
    ref_conv = via_ref[:, 1, : (width - 1) * 3 * hd].view(5, width - 1, 3 * hd)
    ref_state = via_ref[:, 1, (width - 1) * 3 * hd :].view(5, heads, dim, dim)
    ref_out = kda_ref.kda_decode(q, k, v, conv_weights, ref_conv, *args, ref_state, dim**-0.5, rows=picked)
    assert _err(ref_out, expected) <= 1e-6 and _err(via_ref, pool) <= 1e-5
    from h3gen.kernels._arrivals import arrival_counters

    assert not arrival_counters(q.device, "kda_decode", 1).any()  # every head's last part reset its counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,dim,rank,width,parts",
    [(3, 16, 12, 4, 1), (2, 64, 24, 3, 4), (2, 24, 16, 4, 2), (2, 32, 16, 4, 4), (3, 8, 12, 2, 1)],
)
def test_fused_kda_decode_with_low_rank_gates(heads, dim, rank, width, parts, dtype):
    """`gate_up`: the decay and output gates projected up from their low-rank inputs inside the kernel (a rank that
    is no power of two, a head width below its block, one part and several) equal the reference that runs the two
    linears first, and the same kernel fed the projected gates; the states move the same way."""
    from h3gen.kernels.kda import reference as kda_ref
    from h3gen.kernels.kda import triton as kda_triton

    g = torch.Generator(device=DEVICE).manual_seed(heads * dim + rank)
    batch, hd = 2, heads * dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)

    # q, k, v, b and the two low-rank inputs as column slices of one fused projection, as the model passes them.
    fused = rand(batch, 3 * hd + heads + 2 * rank)
    q, k, v, b = fused[:, :hd], fused[:, hd : 2 * hd], fused[:, 2 * hd : 3 * hd], fused[:, 3 * hd : 3 * hd + heads]
    f_a, g_a = fused[:, 3 * hd + heads : 3 * hd + heads + rank], fused[:, 3 * hd + heads + rank :]
    gate_up = rand(2, hd, rank, scale=rank**-0.5)
    conv_weights = [torch.randn(hd, 1, width, generator=g, device=DEVICE) * 0.5 for _ in range(3)]
    a_log = torch.rand(heads, generator=g, device=DEVICE) * 2.0
    dt_bias = torch.randn(hd, generator=g, device=DEVICE) * 0.5
    norm_weight = (1.0 + 0.1 * torch.randn(dim, generator=g, device=DEVICE)).to(dtype)
    conv_state = torch.randn(batch, width - 1, 3 * hd, generator=g, device=DEVICE)
    state = torch.randn(batch, heads, dim, dim, generator=g, device=DEVICE)
    states = {name: (conv_state.clone(), state.clone()) for name in ("reference", "low rank", "projected")}

    def run(name, fn, f, gate, **extra):
        conv, recurrent = states[name]
        return fn(
            q,
            k,
            v,
            conv_weights,
            conv,
            f,
            a_log,
            dt_bias,
            -5.0,
            b,
            gate,
            norm_weight,
            1e-5,
            recurrent,
            dim**-0.5,
            **extra,
        )

    expected = run("reference", kda_ref.kda_decode, f_a, g_a, gate_up=gate_up)
    got = run("low rank", kda_triton.kda_decode, f_a, g_a, gate_up=gate_up, parts=parts)
    projected = run(
        "projected",
        kda_triton.kda_decode,
        torch.nn.functional.linear(f_a, gate_up[0]),
        torch.nn.functional.linear(g_a, gate_up[1]),
        parts=parts,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(got, expected) <= tolerance and _err(got, projected) <= tolerance
    for name in ("low rank", "projected"):
        assert torch.equal(states[name][0], states["reference"][0])  # the conv states shift the same
        assert _err(states[name][1], states["reference"][1]) <= 1e-5
    assert not torch.equal(states["reference"][0], conv_state)
    with pytest.raises(ValueError, match="gate_up"):
        run("low rank", kda_triton.kda_decode, f_a, g_a, gate_up=gate_up[:, :, 1:])


def test_kda_decode_default_parts():
    from h3gen.kernels.kda.triton import default_parts

    assert default_parts(1, 16, 128) == 8 and default_parts(2, 16, 128) == 4 and default_parts(4, 16, 128) == 2
    assert default_parts(8, 16, 128) == 1
    assert default_parts(1, 2, 32) == 2 and default_parts(1, 2, 16) == 1  # never parts under 16 columns
