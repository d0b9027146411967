"""Gated residual (and residual + RMSNorm + modulation in one pass): the Triton kernels against the reference."""

import pytest
import torch
from helpers.kernel_cases import DTYPES, SHAPES, TOLERANCE, half_block_inputs
from helpers.kernel_cases import err as _err

from h3gen.kernels.gated_residual import reference as residual_ref
from h3gen.kernels.gated_residual import triton as residual_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_residual_and_fused_norm_match_reference(shape, dtype):
    x, y, weight, gate, shift, scale, index = half_block_inputs(shape, dtype, seed=2)
    f32 = [t.float() for t in (x, y, gate)]
    assert (
        _err(residual_triton.gated_residual(x, y, gate, index), residual_ref.gated_residual(*f32, index))
        <= TOLERANCE[dtype]
    )
    x_new, modulated = residual_triton.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, 1e-5)
    ref_new, ref_mod = residual_ref.gated_residual_norm_modulate(
        *f32, index, weight.float(), shift.float(), scale.float(), 1e-5
    )
    assert _err(x_new, ref_new) <= TOLERANCE[dtype] and _err(modulated, ref_mod) <= 2 * TOLERANCE[dtype]
    in_place = x.clone()
    residual_triton.gated_residual(in_place, y, gate, index, out=in_place)
    assert torch.equal(in_place, residual_triton.gated_residual(x, y, gate, index))
