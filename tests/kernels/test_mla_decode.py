"""Paged MLA decode: the reference against plain attention over the expanded keys, the Triton kernels against
the reference (odd head counts, ragged lengths ending mid-page)."""

import pytest
import torch
from helpers.k3_reference import max_rel_error
from helpers.kernel_cases import DEVICE, ON_GPU
from helpers.kernel_cases import err as _err

from h3gen.kernels.mla_decode import mla_decode
from h3gen.kernels.mla_decode import reference as mla_ref
from h3gen.kernels.mla_decode import triton as mla_triton


@pytest.mark.parametrize("page_size,lengths", [(4, [9, 1]), (16, [33, 17]), (1, [5, 3])])
def test_mla_decode_paged_matches_expanded_attention(page_size, lengths):
    gen = torch.Generator().manual_seed(page_size)
    heads, rank, rope = 3, 16, 8
    batch = len(lengths)
    pages_per_seq = [-(-n // page_size) for n in lengths]
    total = sum(pages_per_seq) + 2
    pool = torch.randn(total, page_size, rank + rope, generator=gen)
    perm = torch.randperm(total, generator=gen)  # pages scattered through the pool
    table = torch.zeros(batch, max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = perm[used : used + count].int()
        used += count
    q = torch.randn(batch, heads, rank + rope, generator=gen)
    out = mla_decode(q, pool, table, torch.tensor(lengths), 0.3, rank)
    for b, n in enumerate(lengths):
        rows = pool[table[b, : pages_per_seq[b]].long()].reshape(-1, rank + rope)[:n].double()
        probs = torch.softmax(0.3 * q[b].double() @ rows.t(), dim=-1)
        assert max_rel_error(out[b], probs @ rows[:, :rank]) < 1e-6


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
    scale = dim**-0.5
    expected = mla_ref.mla_decode(q, kv_pages, table, seq_lens, scale, rank)
    got = mla_triton.mla_decode(q, kv_pages, table, seq_lens, scale, rank)
    assert got.shape == (len(lengths), heads, rank)
    # A half-precision cache rounds the query to its dtype for the products.
    assert _err(got, expected) <= {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    masked = mla_ref.mla_decode_masked(q, kv_pages, table, seq_lens, scale, rank)
    assert _err(masked, expected) <= 1e-5
    # Split into runs (some empty for the short sequences), then combined: the same attention.
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    for splits in (2, 4, 16):
        runs, lse = mla_triton.mla_decode_partials(q, kv_pages, table, seq_lens, scale, rank, splits, block_s=16)
        assert runs.shape == (len(lengths), heads, splits, rank) and lse.shape == runs.shape[:3]
        assert _err(mla_ref.combine_partials(runs, lse), expected.float()) <= tol
        assert bool(torch.isinf(lse[0, :, 1:]).all()) and not bool(torch.isinf(lse[:, :, 0]).any())
        ref_runs, ref_lse = mla_ref.mla_decode_partials(q, kv_pages, table, seq_lens, scale, rank, splits)
        assert _err(mla_ref.combine_partials(ref_runs, ref_lse), expected.float()) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "batch,heads,nope,rope,rank,v_dim", [(1, 3, 16, 8, 40, 16), (3, 2, 24, 5, 160, 20), (6, 2, 8, 4, 48, 12)]
)
def test_absorbed_query_and_output_match_reference(batch, heads, nope, rope, rank, v_dim, dtype):
    """The MLA decode's absorbed query ([q_nope W_kc | q_pe], float32) and output (latents times W_vc, rounded,
    optionally gated, optionally combining split runs) as one kernel each, against the torch ops they replace; q
    and the weights as the strided views the model passes (W_kc and W_vc are slices of kv_b_proj's weight, in the
    model's dtype)."""
    g = torch.Generator(device=DEVICE).manual_seed(batch + rank)
    q = torch.randn(batch, 2, heads, nope + rope, generator=g, device=DEVICE).to(dtype)[:, 1]
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=g, device=DEVICE) / rank**0.5).to(dtype)
    w = kv_b.view(heads, nope + v_dim, rank)
    w_kc, w_vc = w[:, :nope], w[:, nope:]
    got = mla_triton.absorb_query(q, w_kc, nope)
    assert got.dtype == torch.float32 and _err(got, mla_ref.absorb_query(q, w_kc, nope)) <= 1e-5
    latent = torch.randn(batch, heads, rank, generator=g, device=DEVICE)
    gate = torch.randn(batch, 3, heads * v_dim, generator=g, device=DEVICE).to(dtype)[:, 0]
    runs = torch.randn(batch, heads, 4, rank, generator=g, device=DEVICE)
    lse = torch.randn(batch, heads, 4, generator=g, device=DEVICE) * 3
    lse[0, :, 3] = float("-inf")  # an empty run
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    for given in (None, gate):
        for block_v in (None, 4):
            out = mla_triton.absorb_output(latent, w_vc, dtype, given, block_v=block_v)
            expected = mla_ref.absorb_output(latent, w_vc, dtype, given)
            assert out.dtype == dtype and out.shape == (batch, heads, v_dim)
            assert _err(out, expected) <= tol
        out = mla_triton.absorb_output(runs, w_vc, dtype, given, lse)
        expected = mla_ref.absorb_output(mla_ref.combine_partials(runs, lse), w_vc, dtype, given)
        assert _err(out, expected) <= tol
        assert _err(mla_ref.absorb_output(runs, w_vc, dtype, given, lse), expected) <= 1e-6


@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
)
@pytest.mark.parametrize("rank,rope", [(32, 8), (48, 5)])
def test_latent_row_write_matches_reference(rank, rope, dtype, weight_dtype):
    """A decode step's MLA cache rows (norm of the latent, then k_pe) written through the block table into one
    layer's strided view of the interleaved page pool, in one kernel; other rows untouched."""
    g = torch.Generator(device=DEVICE).manual_seed(rank + rope)
    page, batch = 16, 3
    pool = torch.randn(12, 2, page, rank + rope, generator=g, device=DEVICE).to(dtype)
    table = torch.tensor([[3, 7, 0], [5, 0, 0], [9, 2, 11]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 0, 47], dtype=torch.int32, device=DEVICE)  # rows 20, 0 and 47: pages 7, 5 and 11
    latent = torch.randn(batch, rank, generator=g, device=DEVICE).to(dtype) * 3
    k_pe = torch.randn(batch, rope, generator=g, device=DEVICE).to(dtype)
    weight = (torch.rand(rank, generator=g, device=DEVICE) + 0.5).to(weight_dtype)
    expected, got = pool.clone(), pool.clone()
    mla_ref.write_latent_rows(latent, k_pe, weight, 1e-6, expected[:, 1], table, lens)
    mla_triton.write_latent_rows(latent, k_pe, weight, 1e-6, got[:, 1], table, lens)
    assert not torch.equal(expected, pool)  # the rows were written
    assert torch.allclose(got.float(), expected.float(), rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=0)
    # The same rows written by the absorbed query's launch (one more program per sequence), its query unchanged.
    q = torch.randn(batch, 3, 40, generator=g, device=DEVICE).to(dtype)
    w_kc = torch.randn(3, 24, 72, generator=g, device=DEVICE).to(dtype)
    with_write = pool.clone()
    query = mla_triton.absorb_query(q, w_kc, 24, new_rows=(latent, k_pe, weight, 1e-6, with_write[:, 1], table, lens))
    assert torch.equal(with_write, got) and _err(query, mla_ref.absorb_query(q, w_kc, 24)) <= 1e-5
    with pytest.raises(ValueError, match="new rows"):
        mla_triton.absorb_query(q[:2], w_kc, 24, new_rows=(latent, k_pe, weight, 1e-6, with_write[:, 1], table, lens))
