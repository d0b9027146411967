"""Q/K RMSNorm + RoPE: the Triton kernel against the reference, in bf16/fp32 and as e4m3 heads."""

import pytest
import torch
from helpers.kernel_cases import DTYPES, TOLERANCE, assert_same_fp8, qk_inputs
from helpers.kernel_cases import dequantized as _dequantized
from helpers.kernel_cases import err as _err

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
        for a, b in zip(got, expected, strict=True):
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
    for (values, descale), (ref_values, ref_descale), exact, weight in zip(got, expected, dense, (wq, wk), strict=True):
        assert descale.shape == (batch, heads) and torch.equal(descale, ref_descale)
        assert torch.allclose(descale, rope_ref.fp8_scale(weight).expand(batch, heads))
        assert (exact / descale[0, 0]).abs().max() <= 448  # the bound: nothing saturates
        assert_same_fp8(values, ref_values)
        assert _err(_dequantized(values, ref_values) * descale[0, 0], exact.reshape(-1, head_dim)) < 0.05
