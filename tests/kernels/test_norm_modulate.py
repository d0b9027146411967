"""RMSNorm + modulation: the Triton kernel against the reference, its e4m3 rows, and the CPU dispatch."""

import pytest
import torch
from helpers.kernel_cases import DEVICE, DTYPES, ON_GPU, SHAPES, TOLERANCE, assert_same_rows, half_block_inputs
from helpers.kernel_cases import case as _case
from helpers.kernel_cases import err as _err
from helpers.kernel_cases import rand as _rand

from h3gen.kernels.gated_residual import reference as residual_ref
from h3gen.kernels.gated_residual import triton as residual_triton
from h3gen.kernels.norm_modulate import reference as norm_ref
from h3gen.kernels.norm_modulate import triton as norm_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_modulate_matches_reference(shape, dtype):
    g = _case(1)
    batch, seq, hidden = shape
    x, weight = _rand(*shape, dtype=dtype, generator=g), _rand(hidden, dtype=dtype, generator=g)
    table = _rand(7, 6 * hidden, dtype=dtype, generator=g)  # column slices of one table, as the model passes them
    shift, scale = table[:, :hidden], table[:, hidden : 2 * hidden]
    index = torch.randint(0, 7, (seq,), generator=g, device=DEVICE)
    got = norm_triton.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5)
    expected = norm_ref.rmsnorm_modulate(x.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert _err(got, expected) <= TOLERANCE[dtype]


def test_public_functions_take_the_reference_on_cpu_tensors(monkeypatch):
    from h3gen.kernels import norm_modulate

    monkeypatch.delenv("H3GEN_TRITON", raising=False)
    if ON_GPU:
        pytest.skip("CPU dispatch only")
    x = torch.randn(1, 4, 8)
    table = torch.randn(2, 8)
    index = torch.tensor([0, 1, 1, 0])
    assert torch.equal(
        norm_modulate.rmsnorm_modulate(x, None, table, table, index, 1e-5),
        norm_ref.rmsnorm_modulate(x, None, table, table, index, 1e-5),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_norm_kernels_write_fp8_rows(shape, dtype):
    batch, seq, hidden = shape
    x, y, weight, gate, shift, scale, index = half_block_inputs(shape, dtype, seed=11)

    got = norm_triton.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=True)
    expected = norm_ref.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=True)
    assert got.values.shape == x.shape and got.scale.shape == (batch * seq, 1)
    dense = norm_ref.rmsnorm_modulate(x.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert_same_rows(got, expected, dense)

    x_new, got = residual_triton.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, 1e-5, fp8=True)
    ref_new = residual_ref.gated_residual(x.float(), y.float(), gate.float(), index)
    assert x_new.dtype == dtype and _err(x_new, ref_new) < {torch.float32: 1e-6}.get(dtype, 1e-2)
    # The norm reads the rounded residual the kernel stored: compare with the reference's norm of that same row.
    expected = norm_ref.rmsnorm_modulate(x_new, weight, shift, scale, index, 1e-5, fp8=True)
    dense = norm_ref.rmsnorm_modulate(x_new.float(), weight.float(), shift.float(), scale.float(), index, 1e-5)
    assert_same_rows(got, expected, dense)


@pytest.mark.parametrize("fp8", [False, True])
def test_row_kernels_write_into_columns_of_a_wider_buffer(fp8):
    """A K-extended LoRA input is `[x | x A^T]` in one buffer: the norms and SwiGLU write `x` into its first columns
    (rows strided), the same values (and scales) as into a tensor of their own, and leave the other columns alone."""
    from h3gen.kernels import gated_residual, norm_modulate, swiglu
    from h3gen.kernels.fp8_quant import Fp8Rows
    from h3gen.kernels.swiglu import triton as swiglu_triton

    shape = (2, 5, 40)
    batch, seq, hidden = shape
    x, y, weight, gate, shift, scale, index = half_block_inputs(shape, torch.float32, seed=3)
    up = torch.randn(batch, seq, 2 * hidden, device=DEVICE)

    def wide():
        dtype = torch.float8_e4m3fn if fp8 else torch.float32
        buffer = torch.full((batch * seq, hidden + 24), 7.0, device=DEVICE).to(dtype)
        values = buffer[:, 3 : 3 + hidden].view(shape)
        out = Fp8Rows(values, torch.empty(batch * seq, 1, device=DEVICE)) if fp8 else values
        return buffer, out

    def check(buffer, written, alone):
        got, want = (written.values, alone.values) if fp8 else (written, alone)
        assert torch.equal(got.float(), want.float())
        if fp8:
            assert torch.equal(written.scale, alone.scale)
        rest = torch.cat([buffer[:, :3], buffer[:, 3 + hidden :]], dim=1).float()
        assert torch.all(rest == 7.0)

    for module in (norm_triton, norm_modulate):
        buffer, out = wide()
        written = module.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=fp8, out=out)
        check(buffer, written, module.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, fp8=fp8))
    for module in (residual_triton, gated_residual):
        buffer, out = wide()
        _, written = module.gated_residual_norm_modulate(
            x, y, gate, index, weight, shift, scale, 1e-5, fp8=fp8, normed_out=out
        )
        check(
            buffer,
            written,
            module.gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, 1e-5, fp8=fp8)[1],
        )
    for module in (swiglu_triton, swiglu):
        buffer, out = wide()
        check(buffer, module.swiglu(up, fp8=fp8, out=out), module.swiglu(up, fp8=fp8))
