"""K3 kernels against their references: KDA against fla-core's naive functions, the paged MLA decode against
plain attention over expanded keys, MoE routing against transformers' Kimi-Linear router, the grouped MXFP4 GEMM
against dequantized weights."""

import pytest
import torch
import torch.nn.functional as F

from h3gen.kernels.kda import kda_chunked, kda_gate, kda_recurrent, short_conv
from h3gen.kernels.mla_decode import mla_decode
from h3gen.kernels.moe import grouped_gemm, grouped_mxfp4_gemm, route_topk, sort_by_expert
from h3gen.quant.mxfp4_format import dequantize, quantize
from k3_reference import fla_gate, fla_naive, kimi_linear_torch, max_rel_error


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
    ref_o, ref_s = fla_naive().naive_recurrent_kda(q, k, v, g, beta, scale=dk ** -0.5, initial_state=state,
                                                   output_final_state=True)
    o, s = kda_recurrent(q, k, v, g, beta, dk ** -0.5, state)
    assert max_rel_error(o, ref_o) < 1e-5 and max_rel_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("b,t,h,dk,dv,chunk", [(2, 64, 2, 16, 16, 64), (1, 128, 3, 8, 24, 64), (2, 48, 1, 16, 8, 16)])
def test_kda_chunked_matches_fla_naive_chunk(b, t, h, dk, dv, chunk):
    q, k, v, g, beta, state = _kda_inputs(b, t, h, dk, dv, seed=t + 1)
    ref_o, ref_s = fla_naive().naive_chunk_kda(q, k, v, g, beta, scale=dk ** -0.5, initial_state=state,
                                               output_final_state=True, chunk_size=chunk)
    o, s = kda_chunked(q, k, v, g, beta, dk ** -0.5, state, chunk_size=chunk)
    assert max_rel_error(o, ref_o) < 1e-5 and max_rel_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("t,split", [(1, 0), (37, 20), (99, 64), (70, 3)])
def test_kda_chunked_odd_lengths_and_carried_state_match_fla_recurrent(t, split):
    # Odd lengths (the chunked form pads the tail) and the state handed from one call to the next.
    q, k, v, g, beta, state = _kda_inputs(2, t, 2, 16, 12, seed=t + split)
    ref_o, ref_s = fla_naive().naive_recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=state,
                                                   output_final_state=True)
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
        out, state = short_conv(x[:, i:i + 1], weight, state)
        parts.append(out)
    assert max_rel_error(torch.cat(parts, dim=1), ref) < 1e-6


@pytest.mark.parametrize("page_size,lengths", [(4, [9, 1]), (16, [33, 17]), (1, [5, 3])])
def test_mla_decode_paged_matches_expanded_attention(page_size, lengths):
    gen = torch.Generator().manual_seed(page_size)
    heads, rank, rope = 3, 16, 8
    batch = len(lengths)
    pages_per_seq = [-(-n // page_size) for n in lengths]
    total = sum(pages_per_seq) + 2
    pool = torch.randn(total, page_size, rank + rope, generator=gen)
    perm = torch.randperm(total, generator=gen)  # pages scattered through the pool
    table = torch.zeros(batch, max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = perm[used:used + count].int()
        used += count
    q = torch.randn(batch, heads, rank + rope, generator=gen)
    out = mla_decode(q, pool, table, torch.tensor(lengths), 0.3, rank)
    for b, n in enumerate(lengths):
        rows = pool[table[b, : pages_per_seq[b]].long()].reshape(-1, rank + rope)[:n].double()
        probs = torch.softmax(0.3 * q[b].double() @ rows.t(), dim=-1)
        assert max_rel_error(out[b], probs @ rows[:, :rank]) < 1e-6


@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(8, 2, 1, 1), (12, 3, 4, 2)])
def test_route_topk_matches_transformers_router(experts, top_k, groups, topk_groups):
    modeling = kimi_linear_torch()
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=24, num_local_experts=experts, num_experts_per_tok=top_k, n_group=groups,
                              topk_group=topk_groups, routed_scaling_factor=2.446, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, vocab_size=10)
    router = modeling.KimiLinearTopkRouter(config)
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 24, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    x = torch.randn(20, 24, generator=gen)
    logits, ref_w, ref_ids = router(x)
    w, ids = route_topk(logits, router.e_score_correction_bias, top_k, groups, topk_groups, True, 2.446)
    order_ref, order = ref_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order_ref.values, order.values)
    assert max_rel_error(w.gather(1, order.indices), ref_w.gather(1, order_ref.indices)) < 1e-6


def test_grouped_mxfp4_gemm_matches_dequantized_weights():
    gen = torch.Generator().manual_seed(5)
    experts, k, n = 4, 40, 24  # K not a multiple of 32: padded blocks
    weights = [torch.randn(n, k, generator=gen) for _ in range(experts)]
    quantized = [quantize(w) for w in weights]
    ids = torch.randint(0, experts, (9, 2), generator=gen)
    order, offsets = sort_by_expert(ids, experts)
    assert torch.equal(ids.reshape(-1)[order], ids.reshape(-1).sort(stable=True).values)
    x = torch.randn(order.numel(), k, generator=gen)
    out = grouped_mxfp4_gemm(x, offsets, [p for p, _ in quantized], [s for _, s in quantized])
    dense = grouped_gemm(x, offsets, [dequantize(p, s, in_features=k) for p, s in quantized])
    assert max_rel_error(out, dense) < 1e-6
    expert_of_row = ids.reshape(-1)[order]
    expected = torch.stack([x[i] @ dequantize(*quantized[e], in_features=k).t() for i, e in enumerate(expert_of_row)])
    assert max_rel_error(out, expected) < 1e-5
