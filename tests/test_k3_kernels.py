"""The K3 decode kernels against their torch references: on the CPU under TRITON_INTERPRET=1, on a GPU natively.
Odd sizes (heads below the head block, ragged lengths ending mid-page, strided pool views)."""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are defined

from h3gen.kernels.mla_decode import reference as mla_ref  # noqa: E402
from h3gen.kernels.mla_decode import triton as mla_triton  # noqa: E402
from h3gen.kernels.moe import reference as moe_ref  # noqa: E402
from h3gen.kernels.moe import triton as moe_triton  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def _err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if ON_GPU else torch.float16])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("heads,rank,rope", [(5, 32, 8), (16, 64, 16), (20, 48, 8)])
def test_paged_mla_decode_matches_reference(page, heads, rank, rope, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(heads + rank + page)
    dim = rank + rope
    lengths = [1, page, 3 * page + 5]
    max_pages = max(-(-n // page) for n in lengths) + 1
    layers = 2  # the pool interleaves MLA layers: the kernel reads a strided view of one of them
    pool = torch.randn(40, layers, page, dim, generator=g, device=DEVICE).to(dtype)
    kv_pages = pool[:, 1]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(page))
    table = torch.zeros(len(lengths), max_pages, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(lengths):
        count = -(-n // page)
        table[b, :count] = order[used : used + count].to(torch.int32)
        used += count
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), heads, dim, generator=g, device=DEVICE)
    scale = dim ** -0.5
    expected = mla_ref.mla_decode(q, kv_pages, table, seq_lens, scale, rank)
    got = mla_triton.mla_decode(q, kv_pages, table, seq_lens, scale, rank)
    assert got.shape == (len(lengths), heads, rank)
    # A half-precision cache rounds the query to its dtype for the products.
    assert _err(got, expected) <= {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    masked = mla_ref.mla_decode_masked(q, kv_pages, table, seq_lens, scale, rank)
    assert _err(masked, expected) <= 1e-5
