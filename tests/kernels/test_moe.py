"""MoE: routing against transformers' Kimi-Linear router, the grouped MXFP4 GEMM against dequantized weights, and
the Triton routing and expert kernels (dense and MXFP4) against their references."""

import pytest
import torch
from helpers.k3_reference import kimi_linear_torch, max_rel_error
from helpers.kernel_cases import DEVICE
from helpers.kernel_cases import err as _err

from h3gen.kernels.moe import grouped_gemm, grouped_mxfp4_gemm, route_topk, sort_by_expert
from h3gen.kernels.moe import reference as moe_ref
from h3gen.kernels.moe import triton as moe_triton
from h3gen.quant.mxfp4_format import dequantize, quantize


@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(8, 2, 1, 1), (12, 3, 4, 2)])
def test_route_topk_matches_transformers_router(experts, top_k, groups, topk_groups):
    modeling = kimi_linear_torch()
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(
        hidden_size=24,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=2.446,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        vocab_size=10,
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,experts,n,k", [(1, 4, 37, 300), (7, 9, 64, 96), (12, 3, 130, 17)])
def test_expert_gemv_matches_reference(rows, experts, n, k, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(rows * 31 + n)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    weight = torch.randn(experts, n, k, generator=g, device=DEVICE).to(dtype)
    ids = torch.randint(0, experts, (rows,), generator=g, device=DEVICE)
    got = moe_triton.expert_gemv(x, weight, ids)
    expected = moe_ref.expert_gemv(x.float(), weight.float(), ids)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert _err(got, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)
    # Equal to running each row through its expert's matrix.
    row = 0 if rows == 1 else rows // 2
    direct = x[row].float() @ weight[ids[row]].float().t()
    assert _err(got[row], direct) <= (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,top_k,experts,inter,width", [(1, 6, 8, 48, 70), (3, 2, 5, 300, 33), (2, 1, 3, 17, 130), (2, 8, 9, 600, 24)]
)  # 2 x 8 slots: three K steps
def test_decode_expert_chain_matches_reference(tokens, top_k, experts, inter, width, dtype):
    """Router logits, the up/gate GEMV reading each token's row for its k slots, and the fused SwiGLU + down GEMV +
    weighted slot sum, each against its reference and together against the plain per-pair computation."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens * 7 + inter)
    h = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    router = torch.randn(experts, width, generator=g, device=DEVICE)  # float32, as K3 keeps it
    logits = moe_triton.router_logits(h, router)
    assert logits.dtype == torch.float32 and _err(logits, moe_ref.router_logits(h, router)) <= 1e-5
    up_gate = torch.randn(experts, 2 * inter, width, generator=g, device=DEVICE).to(dtype) / width**0.5
    down = torch.randn(experts, width, inter, generator=g, device=DEVICE).to(dtype) / inter**0.5
    ids = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k] for t in range(tokens)]
    ).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    both = moe_triton.expert_gemv(h, up_gate, ids.reshape(-1), top_k)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert both.shape == (tokens * top_k, 2 * inter)
    assert _err(both, moe_ref.expert_gemv(h.float(), up_gate.float(), ids.reshape(-1), top_k)) <= tolerance
    out = moe_triton.expert_swiglu_down(both, down, ids, weights)
    assert out.shape == (tokens, width) and out.dtype == dtype
    assert _err(out, moe_ref.expert_swiglu_down(both, down, ids, weights)) <= tolerance
    base = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)  # another output to add (shared expert)
    summed = moe_triton.expert_swiglu_down(both, down, ids, weights, add=base)
    assert _err(summed, moe_ref.expert_swiglu_down(both, down, ids, weights, base)) <= tolerance
    assert _err(summed, out.double() + base.double()) <= 2 * tolerance
    plain = torch.zeros(tokens, width, dtype=torch.float64, device=DEVICE)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            up, gate = (up_gate[e].double() @ h[t].double()).chunk(2)
            plain[t] += weights[t, j].double() * (down[e].double() @ (up * torch.sigmoid(gate) * gate))
    assert _err(out, plain) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "tokens,experts,top_k,bias,renormalize,always",
    [
        (1, 64, 6, True, True, 0),
        (5, 37, 3, False, True, 1),
        (9, 8, 2, True, False, 2),
        (3, 64, 6, True, True, 1),
        (2, 896, 16, True, True, 1),
        (3, 200, 8, False, False, 0),
    ],
)
def test_route_topk_matches_reference(tokens, experts, top_k, bias, renormalize, always):
    g = torch.Generator(device=DEVICE).manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    correction = torch.randn(experts, generator=g, device=DEVICE) * 0.1 if bias else None
    expected_w, expected_ids = moe_ref.route_topk(
        logits, correction, top_k, renormalize=renormalize, scaling=2.5, always=always
    )
    got_w, got_ids = moe_triton.route_topk(logits, correction, top_k, renormalize, 2.5, always)
    assert got_ids.shape == (tokens, top_k + always) and torch.equal(got_ids, expected_ids)
    assert _err(got_w, expected_w) <= 1e-6
    # the always-on experts follow the routed ones, unscaled, and leave the routed weights as they were
    assert torch.equal(got_ids[:, top_k:], torch.arange(experts, experts + always, device=DEVICE).expand(tokens, -1))
    assert torch.equal(got_w[:, top_k:], torch.ones(tokens, always, device=DEVICE))
    plain_w, plain_ids = moe_ref.route_topk(logits, correction, top_k, renormalize=renormalize, scaling=2.5)
    assert torch.equal(got_ids[:, :top_k], plain_ids) and _err(got_w[:, :top_k], plain_w) <= 1e-6


@pytest.mark.parametrize("experts,top_k", [(64, 6), (37, 5), (300, 7)])
def test_route_topk_breaks_ties_by_lower_index(experts, top_k):
    """Tied scores (logits on a coarse grid, one value shared by many experts) are taken in index order, as a
    stable descending sort orders them: both the all-at-once ranking (up to 128 experts) and the repeated max."""
    g = torch.Generator(device=DEVICE).manual_seed(experts)
    logits = torch.randint(-2, 3, (4, experts), generator=g, device=DEVICE).float() * 0.5
    logits[1] = 0.0  # every expert tied
    logits[2, -3:] = 4.0  # a tie at the top, at the end of the row
    _, got_ids = moe_triton.route_topk(logits, None, top_k, True, 1.0)
    expected = torch.sort(logits.sigmoid(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(got_ids, expected)


@pytest.mark.parametrize("always,block_k", [(1, None), (2, 16)])
def test_expert_gemv_with_always_on_slots_matches_reference(always, block_k):
    """Always-on slots (the last of each token's, experts stacked after the routed ones) take their expert from
    their slot, not from the ids: the same output as the reference reading the ids (two K steps with block_k 16)."""
    g = torch.Generator(device=DEVICE).manual_seed(always)
    tokens, routed, experts, n, k = 3, 2, 5, 12, 24
    x = torch.randn(tokens, k, generator=g, device=DEVICE)
    weight = torch.randn(experts + always, n, k, generator=g, device=DEVICE)
    chosen = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:routed] for t in range(tokens)]
    ).to(DEVICE)
    ids = torch.cat([chosen, torch.arange(experts, experts + always, device=DEVICE).expand(tokens, -1)], dim=1)
    top_k = routed + always
    got = moe_triton.expert_gemv(x, weight, ids.reshape(-1), top_k, block_k=block_k, always=always, early=True)
    assert _err(got, moe_ref.expert_gemv(x, weight, ids.reshape(-1), top_k)) <= 1e-6
    with pytest.raises(ValueError, match="always-on"):
        moe_triton.expert_gemv(x, weight, ids.reshape(-1), top_k, always=top_k + 1)


@pytest.mark.parametrize("ahead", [0, 2, 3, 4])
def test_expert_tail_with_k_steps_loaded_ahead_matches_reference(ahead):
    """The SwiGLU + down tail with 0 to 4 of its K steps' weights loaded before the wait: the same sums (five K
    steps of 128 here, so the loop still runs after the steps loaded ahead, and ahead steps past the end masked)."""
    g = torch.Generator(device=DEVICE).manual_seed(ahead)
    tokens, top_k, experts, inter, width = 2, 3, 5, 600, 24
    both = torch.randn(tokens * top_k, 2 * inter, generator=g, device=DEVICE)
    down = torch.randn(experts, width, inter, generator=g, device=DEVICE) / inter**0.5
    ids = torch.tensor([[0, 3, 4], [2, 1, 3]], device=DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    expected = moe_ref.expert_swiglu_down(both, down, ids, weights)
    got = moe_triton.expert_swiglu_down(both, down, ids, weights, block_k=128, ahead=ahead)
    assert _err(got, expected) <= 1e-5
    short = moe_triton.expert_swiglu_down(both, down, ids, weights, block_k=512, ahead=ahead)  # 2 steps
    assert _err(short, expected) <= 1e-5
    with pytest.raises(ValueError, match="K steps ahead"):
        moe_triton.expert_swiglu_down(both, down, ids, weights, ahead=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,experts,width,top_k,always,bias",
    [(1, 64, 128, 6, 1, True), (3, 37, 40, 3, 0, False), (5, 8, 33, 2, 2, True)],
)
def test_router_topk_matches_router_then_topk(tokens, experts, width, top_k, always, bias, dtype):
    """The fused router + top-k (and its residual-update + norm prologue) against the separate reference ops; the
    token's last program routes it and sets its arrival counter back to zero."""
    from h3gen.kernels._arrivals import arrival_counters
    from h3gen.kernels.rmsnorm import reference as norm_ref

    g = torch.Generator(device=DEVICE).manual_seed(tokens * experts + width)
    x = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    delta = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    router = torch.randn(experts, width, generator=g, device=DEVICE) / width**0.5  # float32, as K3 keeps it
    norm_weight = (1.0 + 0.1 * torch.randn(width, generator=g, device=DEVICE)).to(dtype)
    correction = torch.randn(experts, generator=g, device=DEVICE) * 0.1 if bias else None
    route = (correction, top_k, True, 2.5, always)

    def expected(rows):
        return moe_ref.route_topk(
            moe_ref.router_logits(rows, router), correction, top_k, renormalize=True, scaling=2.5, always=always
        )

    got_w, got_ids = moe_triton.router_topk(x, router, *route)
    want_w, want_ids = expected(x)
    assert torch.equal(got_ids, want_ids) and _err(got_w, want_w) <= 1e-6
    total, normed, got_w, got_ids = moe_triton.router_topk(x, router, *route, residual=(delta, norm_weight, 1e-6))
    want_total, want_normed = norm_ref.add_rms_norm(x, delta, norm_weight, 1e-6)
    want_w, want_ids = expected(want_normed)
    assert torch.equal(total, want_total) and normed.dtype == want_normed.dtype
    assert _err(normed, want_normed) <= (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(got_ids, want_ids) and _err(got_w, want_w) <= 1e-6
    assert not arrival_counters(x.device, "router_topk", 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,experts,top_k,inter,width", [(37, 5, 2, 24, 40), (3, 9, 3, 16, 33), (70, 4, 1, 20, 16)]
)
def test_grouped_expert_gemm_matches_per_expert_reference(tokens, experts, top_k, inter, width, dtype):
    """The prefill MoE path: pairs grouped into expert blocks on the device, [up; gate] GEMM with SwiGLU fused, then
    the down GEMM, against the per-expert grouped reference."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens + experts)
    h = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    up_gate = (torch.randn(experts, 2 * inter, width, generator=g, device=DEVICE) / width**0.5).to(dtype)
    down = (torch.randn(experts, width, inter, generator=g, device=DEVICE) / inter**0.5).to(dtype)
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=g, device=DEVICE)  # the last expert gets none
    pairs = ids.reshape(-1)
    rows, block_expert = moe_triton.moe_blocks(pairs, experts, 16)
    act = moe_triton.grouped_expert_gemm(
        h, up_gate, rows, block_expert, pairs.numel(), top_k, swiglu=True, block_m=16, block_n=16, block_k=16
    )
    out = moe_triton.grouped_expert_gemm(
        act, down, rows, block_expert, pairs.numel(), 1, block_m=16, block_n=16, block_k=16
    )
    order, offsets = moe_ref.sort_by_expert(ids, experts)
    inputs = h.float()[order // top_k]
    both = moe_ref.grouped_gemm(inputs, offsets, list(up_gate.float()))
    expected_act = both[:, :inter] * torch.nn.functional.silu(both[:, inter:])
    expected = moe_ref.grouped_gemm(expected_act, offsets, list(down.float()))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(act[order], expected_act) <= tolerance
    assert _err(out[order], expected) <= tolerance
    # Every pair sits in exactly one block of its own expert.
    placed = rows[rows >= 0]
    assert sorted(placed.tolist()) == list(range(pairs.numel()))
    block_of = torch.nonzero(rows.view(-1, 16) >= 0)[:, 0]
    assert torch.equal(block_expert[block_of], pairs[placed])


@pytest.mark.parametrize(
    "tokens,top_k,experts,n,k", [(1, 1, 3, 37, 64), (3, 2, 5, 20, 40), (2, 2, 2, 48, 300), (1, 6, 8, 16, 520)]
)
def test_mxfp4_expert_gemv_matches_reference(tokens, top_k, experts, n, k):
    """Each (token, slot) pair through its MXFP4 expert, reading the token's row (odd widths end inside a group of
    32; 520 spans three 256-wide steps), against the dequantized per-pair product."""
    from h3gen.quant.mxfp4_format import quantize

    g = torch.Generator(device=DEVICE).manual_seed(tokens * n + k)
    weights = [torch.randn(n, k, generator=g, device=DEVICE) for _ in range(experts)]
    packed, scales = (torch.stack(parts) for parts in zip(*(quantize(w) for w in weights), strict=True))
    x = torch.randn(tokens, k, generator=g, device=DEVICE)
    ids = torch.randint(0, experts, (tokens * top_k,), generator=g, device=DEVICE)
    expected = moe_ref.expert_gemv_mxfp4(x, packed, scales, ids, top_k)
    got = moe_triton.expert_gemv_mxfp4(x, packed, scales, ids, top_k)
    assert got.shape == (tokens * top_k, n)
    assert _err(got, expected) <= 1e-5
    pair = tokens * top_k - 1
    direct = moe_ref.dequantize(packed[ids[pair]], scales[ids[pair]], torch.float64, k) @ x[pair // top_k].double()
    assert _err(got[pair], direct) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,top_k,experts,inter,width", [(1, 6, 8, 48, 70), (3, 2, 5, 300, 33), (2, 1, 3, 17, 130), (10, 3, 6, 80, 40)]
)  # 10 tokens: the slot loop
def test_mxfp4_decode_expert_tail_matches_reference(tokens, top_k, experts, inter, width, dtype):
    """SwiGLU, the MXFP4 down experts and the weighted slot sum in one kernel, against the reference and against the
    plain per-pair computation over the dequantized experts."""
    from h3gen.quant.mxfp4_format import dequantize, quantize

    g = torch.Generator(device=DEVICE).manual_seed(tokens * 13 + inter)
    down = [torch.randn(width, inter, generator=g, device=DEVICE) / inter**0.5 for _ in range(experts)]
    packed, scales = (torch.stack(parts) for parts in zip(*(quantize(w) for w in down), strict=True))
    both = torch.randn(tokens * top_k, 2 * inter, generator=g, device=DEVICE).to(dtype)
    ids = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k] for t in range(tokens)]
    ).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    out = moe_triton.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)
    assert out.shape == (tokens, width) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(out, moe_ref.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)) <= tolerance
    plain = torch.zeros(tokens, width, dtype=torch.float64, device=DEVICE)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            up, gate = both[t * top_k + j].double().chunk(2)
            weight = dequantize(packed[e], scales[e], torch.float64, inter)
            plain[t] += weights[t, j].double() * (weight @ (up * torch.sigmoid(gate) * gate))
    assert _err(out, plain) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_word_decoding_covers_every_code_and_scale_edge():
    """Every E2M1 code at every position of a word, tiny, unit and huge scales, and NaN scales, through the
    word-decoding expert GEMV against float64 (activations are powers of two, so every product is exact)."""
    from h3gen.quant.mxfp4_format import dequantize

    n, k = 5, 64
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()[None]  # low nibble = even element
    scales = torch.tensor([[1, 127], [100, 130], [180, 60], [0, 3], [255, 127]], dtype=torch.uint8)[None]
    x = torch.tensor([2.0 ** (i % 5 - 2) for i in range(k)])[None]
    ids = torch.zeros(1, dtype=torch.long)
    got = moe_triton.expert_gemv_mxfp4(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE)).cpu()
    expected = dequantize(packed[0], scales[0], torch.float64, k) @ x[0].double()
    assert torch.isnan(got[0, 4]) and torch.isnan(expected[4])
    assert torch.allclose(got[0, :4].double(), expected[:4], rtol=1e-6, atol=0)
    assert 0 < abs(got[0, 3]) < 1e-30  # a row of the smallest scales keeps its (tiny) value
