"""The few-row linears (plain, grouped, with an RMSNorm, with the argmax left as keys) against their references."""

import pytest
import torch
from helpers.kernel_cases import DEVICE
from helpers.kernel_cases import err as _err

from h3gen.kernels.argmax import triton as argmax_triton
from h3gen.kernels.gemv import reference as gemv_ref
from h3gen.kernels.gemv import triton as gemv_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "rows,n,k,block_k", [(1, 37, 300, None), (3, 64, 96, 32), (4, 130, 17, None), (2, 5, 2100, 512)]
)  # 2100 over 512: five K steps, the last partial
def test_few_row_linears_match_reference(rows, n, k, block_k, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = gemv_triton.rows_linear(x, weight, block_k=block_k)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert _err(got, gemv_ref.rows_linear(x.float(), weight.float())) <= tol
    # Groups: two linears of one shape over side-by-side slices of one row (the KDA gates' layout).
    both = torch.randn(rows, 3 * k, generator=g, device=DEVICE).to(dtype)
    pairs = both.as_strided((2, rows, k), (k, both.stride(0), 1))
    weights = (torch.randn(2, n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    got = gemv_triton.grouped_rows_linear(pairs, weights, block_k=block_k)
    assert got.shape == (2, rows, n)
    assert _err(got, gemv_ref.grouped_rows_linear(pairs.float(), weights.float())) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter truncates to bfloat16)
@pytest.mark.parametrize(
    "rows,n,k,add",
    [(1, 37, 300, True), (2, 64, 96, False), (3, 130, 17, True), (4, 5, 2048, True), (1, 9, 2048, False)],
)
def test_normed_few_row_linear_matches_reference(rows, n, k, add, dtype):
    """The residual add + RMSNorm in the GEMV's prologue: the stored sum exactly as the reference's, the output
    as the reference norm followed by the reference linear (the norm's float32 sum may be reduced in another order,
    so within a rounding of it)."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * 11 + k)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    residual = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype) if add else None
    norm = (1 + 0.1 * torch.randn(k, generator=g, device=DEVICE)).to(dtype)
    weight = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    total, got = gemv_triton.normed_rows_linear(x, norm, 1e-6, weight, residual)
    want_total, want = gemv_ref.normed_rows_linear(x, norm, 1e-6, weight, residual)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.equal(total, want_total) and (add or total is x)
    normed = want_total.float() * torch.rsqrt(want_total.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = gemv_ref.rows_linear((norm.float() * normed), weight.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert _err(got, want.float()) <= tol and _err(got, exact) <= tol
    with pytest.raises(ValueError, match="normed_rows_linear"):
        gemv_triton.normed_rows_linear(torch.zeros(5, k, device=DEVICE, dtype=dtype), norm, 1e-6, weight)
    if not add:  # a strided view of x (MLA's q slice of the fused input projection)
        wide = torch.randn(rows, k + 3, generator=g, device=DEVICE).to(dtype)
        view = wide[:, 2 : k + 2]
        total, got = gemv_triton.normed_rows_linear(view, norm, 1e-6, weight)
        assert total is view and _err(got, gemv_ref.normed_rows_linear(view, norm, 1e-6, weight)[1].float()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["random", "ties", "zeros", "nan"])
@pytest.mark.parametrize("rows,n,k,normed", [(1, 37, 64, True), (3, 130, 256, False), (4, 301, 512, True)])
def test_linear_argmax_left_as_keys_matches_torch(rows, n, k, normed, case, dtype):
    """The head GEMV leaves each row's argmax as keys that `argmax_from_keys` reads: torch's argmax of the output as
    stored. Through an identity weight the outputs are x's values exactly: a row's maximum repeated in three tiles
    (the first wins), zero as the maximum at two columns (the first wins; the first may come out as -0, which
    equals +0), or a NaN in two columns (the first NaN wins, whatever the values); twice in a row, so the keys are
    back at zero after each launch."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * 13 + n)
    x = torch.randn(rows, k, generator=g, device=DEVICE)
    weight = torch.randn(n, k, generator=g, device=DEVICE) / k**0.5
    if case != "random":
        weight = torch.eye(n, k, device=DEVICE)
    if case == "ties":
        for r in range(rows):
            x[r, [n // 5 + r, n // 3 + r, n - 2 - r]] = x[r].max() + 1
    if case == "zeros":
        x = -x.abs() - 0.25
        x[:, 2], x[:, 7] = -0.0, 0.0
        weight[2, 7] = -0.0  # so output 2 sums only negative zeros: -0 stays -0
    if case == "nan":
        weight[n // 2, 0], weight[n - 3, 0] = -float("nan"), float("nan")  # the first with its sign bit set
    x, weight = x.to(dtype), weight.to(dtype)
    norm = torch.ones(k, device=DEVICE, dtype=dtype)
    for _ in range(2):
        keys = argmax_triton.key_slots(x.device, rows)
        if normed:
            _, out = gemv_triton.normed_rows_linear(x, norm, 1e-6, weight, keys=keys)
        else:
            out = gemv_triton.rows_linear(x, weight, keys=keys)
        got = argmax_triton.argmax_from_keys(keys, rows)
        assert got.dtype == torch.int64 and torch.equal(got, out.argmax(dim=-1)), (got, out.argmax(dim=-1))
        assert not keys.any()
    with pytest.raises(ValueError, match="rows_linear"):
        gemv_triton.grouped_rows_linear(torch.stack([x, x]), torch.stack([weight, weight]), keys=keys)
