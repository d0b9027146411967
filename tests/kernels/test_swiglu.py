"""SwiGLU: the Triton kernel against the reference, in bf16/fp32 and as e4m3 rows."""

import pytest
from kernel_cases import DTYPES, TOLERANCE, assert_same_rows, case as _case, err as _err, rand as _rand

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


def _update(rows: int, width: int, rank: int, dtype, generator):
    """A low-rank update `(hidden, up)` whose hidden is a column slice of a wider projection, as a LoRA group's."""
    projected = _rand(rows, rank + 5, dtype=dtype, generator=generator)
    up = _rand(2 * width, rank, dtype=dtype, generator=generator, scale=0.3)
    return projected[:, 3 : 3 + rank], up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rank", [((1, 13, 2 * 300), 8), ((2, 3, 2 * 150), 40), ((5, 2 * 64), 130)])
def test_swiglu_adds_a_low_rank_update_as_it_reads(shape, rank, dtype):
    g = _case(21)
    x = _rand(*shape, dtype=dtype, generator=g)
    rows = x.numel() // shape[-1]
    hidden, up = _update(rows, shape[-1] // 2, rank, dtype, g)
    updated = x.float() + (hidden.float() @ up.float().t()).view(shape)
    expected = swiglu_ref.swiglu(updated)
    assert _err(swiglu_ref.swiglu(x, update=(hidden, up)), expected) <= TOLERANCE[dtype]
    for blocks in ((64, 128), (16, 32)):  # one tile over the rows, or several with a masked edge
        got = swiglu_triton.swiglu(x, update=(hidden, up), update_blocks=blocks)
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
        assert _err(got, expected) <= TOLERANCE[dtype]
        rows_fp8 = swiglu_triton.swiglu(x, fp8=True, update=(hidden, up), update_blocks=blocks)
        assert_same_rows(rows_fp8, swiglu_ref.swiglu(updated, fp8=True), expected)
