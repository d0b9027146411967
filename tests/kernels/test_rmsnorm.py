"""RMSNorm (alone and after a residual add): the Triton kernel against the reference, the reference against torch."""

import pytest
import torch
import torch.nn.functional as F
from helpers.kernel_cases import DEVICE
from helpers.kernel_cases import err as _err

from h3gen.kernels.rmsnorm import reference as norm_ref
from h3gen.kernels.rmsnorm import triton as norm_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 70), (3, 5, 200), (4, 33)])
def test_rms_norm_alone_and_after_a_residual_add_matches_reference(shape, dtype):

    g = torch.Generator(device=DEVICE).manual_seed(len(shape) * 100 + shape[-1])
    x, y = (torch.randn(*shape, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=g, device=DEVICE).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-3
    assert _err(norm_triton.rms_norm(x, weight, 1e-6), norm_ref.rms_norm(x, weight, 1e-6)) <= tolerance
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, device=DEVICE).to(dtype)
    view = wide[..., 1 : shape[-1] + 1]  # a strided view, as the model hands over slices
    assert _err(norm_triton.rms_norm(view, weight, 1e-6), norm_ref.rms_norm(view, weight, 1e-6)) <= tolerance
    total, normed = norm_triton.add_rms_norm(x, y, weight, 1e-6)
    ref_total, ref_normed = norm_ref.add_rms_norm(x, y, weight, 1e-6)
    assert total.dtype == dtype and torch.equal(total, ref_total)  # one rounding of the same sum
    assert normed.shape == x.shape and _err(normed, ref_normed) <= tolerance


@pytest.mark.parametrize("shape,eps", [((3, 5, 200), 1e-6), ((1, 70), 1e-5)])
def test_rms_norm_reference_matches_torch(shape, eps):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g) * 4
    weight = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(norm_ref.rms_norm(x, weight, eps), F.rms_norm(x, (shape[-1],), weight, eps))
    total, normed = norm_ref.add_rms_norm(x, x.flip(-1), weight, eps)
    torch.testing.assert_close(normed, F.rms_norm(x + x.flip(-1), (shape[-1],), weight, eps))


@pytest.mark.parametrize("shape", [(3, 5, 200), (7, 2048)])
def test_a_float32_norm_hands_bf16_over_in_one_pass(shape):
    """`out_dtype`: the float32 norm of a float32 residual cast once to bf16, as `norm(x.float()).to(bf16)`."""
    g = torch.Generator(device=DEVICE).manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g, device=DEVICE)
    weight = torch.randn(shape[-1], generator=g, device=DEVICE)
    want = norm_ref.rms_norm(x, weight, 1e-5).to(torch.bfloat16)
    got = norm_triton.rms_norm(x, weight, 1e-5, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and _err(got.float(), want.float()) <= 8e-3
    assert torch.equal(norm_ref.rms_norm(x, weight, 1e-5, out_dtype=torch.bfloat16), want)
