"""Q/K RMSNorm + RoPE: the Triton kernel against the reference, in bf16/fp32 and as e4m3 heads."""

import pytest
import torch
from kernel_cases import DTYPES, TOLERANCE, assert_same_fp8, dequantized as _dequantized, err as _err, qk_inputs

from h3gen.kernels.qk_norm_rope import reference as rope_ref
from h3gen.kernels.qk_norm_rope import triton as rope_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rotary", [(7, 24, 12), (3, 128, 96), (5, 32, 32)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_qk_norm_rope_matches_reference(heads, head_dim, rotary, heads_first, dtype):
    q, k, wq, wk, cos, sin = qk_inputs(heads, head_dim, rotary, dtype, seed=3)
    expected = rope_ref.qk_norm_rope(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first)
    for per_program in (64, 2):  # all heads in one program, or groups of 2 (the last group partly masked)
        got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, heads_per_program=per_program)
        for a, b in zip(got, expected):
            assert a.shape == b.shape and a.dtype == dtype and a.is_contiguous()
            assert _err(a, b) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rotary", [(7, 24, 12), (3, 128, 96)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_qk_norm_rope_writes_fp8_heads_with_a_bound_scale(heads, head_dim, rotary, heads_first, dtype):
    batch = 2
    q, k, wq, wk, cos, sin = qk_inputs(heads, head_dim, rotary, dtype, seed=14, batch=batch)
    wq[3] = 6.0  # one channel whose weight dominates, as trained norms have: the bound must hold, values stay normal
    got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, fp8=True)
    expected = rope_ref.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, fp8=True)
    dense = rope_ref.qk_norm_rope(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first)
    for (values, descale), (ref_values, ref_descale), exact, weight in zip(got, expected, dense, (wq, wk)):
        assert descale.shape == (batch, heads) and torch.equal(descale, ref_descale)
        assert torch.allclose(descale, rope_ref.fp8_scale(weight).expand(batch, heads))
        assert (exact / descale[0, 0]).abs().max() <= 448  # the bound: nothing saturates
        assert_same_fp8(values, ref_values)
        assert _err(_dequantized(values, ref_values) * descale[0, 0], exact.reshape(-1, head_dim)) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,rotary,rank", [(7, 24, 12, 8), (3, 128, 96, 130), (2, 32, 32, 40)])
@pytest.mark.parametrize("heads_first", [False, True])
def test_qk_norm_rope_adds_low_rank_updates_as_it_reads(heads, head_dim, rotary, rank, heads_first, dtype):
    batch, seq = 2, 19
    q, k, wq, wk, cos, sin = qk_inputs(heads, head_dim, rotary, dtype, seed=8, batch=batch, seq=seq)
    g = torch.Generator(device=q.device).manual_seed(9)
    # hidden: a column slice of a wider projection (a LoRA group's); k's update is left out, as when only q adapts
    projected = torch.randn(batch * seq, rank + 4, generator=g, device=q.device).to(dtype)
    hidden = projected[:, 2 : 2 + rank]
    up = (torch.randn(heads * head_dim, rank, generator=g, device=q.device) * 0.2).to(dtype)
    updated = q.float() + (hidden.float() @ up.float().t()).view(q.shape)
    expected = rope_ref.qk_norm_rope(updated, k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first)
    reference = rope_ref.qk_norm_rope(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-5, heads_first,
                                      updates=((hidden.float(), up.float()), None))
    assert all(_err(a, b) <= 1e-6 for a, b in zip(reference, expected))
    for rows in (64, 16):  # one tile over the rows, or several with a masked edge
        got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, updates=((hidden, up), None),
                                       update_rows=rows)
        for a, b in zip(got, expected):
            assert a.shape == b.shape and a.dtype == dtype and a.is_contiguous()
            assert _err(a, b) <= TOLERANCE[dtype]
        got = rope_triton.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5, heads_first, fp8=True,
                                       updates=((hidden, up), (hidden, up)), update_rows=rows)
        expected_fp8 = rope_ref.qk_norm_rope(updated, k.float() + (updated - q.float()), wq, wk, cos, sin, 1e-5,
                                             heads_first, fp8=True)
        for (values, descale), (ref_values, ref_descale) in zip(got, expected_fp8):
            assert torch.equal(descale, ref_descale)
            assert_same_fp8(values, ref_values)
