"""SwiGLU: the Triton kernel against the reference, in bf16/fp32 and as e4m3 rows."""

import pytest
from helpers.kernel_cases import DTYPES, TOLERANCE, assert_same_rows
from helpers.kernel_cases import case as _case
from helpers.kernel_cases import err as _err
from helpers.kernel_cases import rand as _rand

from h3gen.kernels.swiglu import reference as swiglu_ref
from h3gen.kernels.swiglu import triton as swiglu_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 13, 2 * 300), (2, 3, 2 * 1500), (4, 2 * 64)])
def test_swiglu_matches_reference(shape, dtype):
    x = _rand(*shape, dtype=dtype, generator=_case(4))
    got = swiglu_triton.swiglu(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert _err(got, swiglu_ref.swiglu(x.float())) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 13, 2 * 300), (2, 3, 2 * 1500), (4, 2 * 64)])
def test_swiglu_writes_fp8_rows(shape, dtype):
    x = _rand(*shape, dtype=dtype, generator=_case(12), scale=3.0)
    got = swiglu_triton.swiglu(x, fp8=True)
    assert got.values.shape == (*shape[:-1], shape[-1] // 2)
    assert_same_rows(got, swiglu_ref.swiglu(x, fp8=True), swiglu_ref.swiglu(x.float()))
