"""The K3 Triton kernels (few-row linears, paged MLA decode, fused KDA decode, RMSNorm, router logits, top-k routing, expert GEMVs
dense and MXFP4, the fused SwiGLU + down + slot sum, grouped expert GEMM) against their torch references: on the CPU under TRITON_INTERPRET=1, on a GPU natively. Odd
sizes (heads below the head block, ragged lengths ending mid-page, strided pool views). The references themselves
are checked against fla-core and transformers in test_k3_kernels.py."""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before the kernels are defined

from h3gen.kernels.argmax import reference as argmax_ref  # noqa: E402
from h3gen.kernels.argmax import triton as argmax_triton  # noqa: E402
from h3gen.kernels.gemv import reference as gemv_ref  # noqa: E402
from h3gen.kernels.sampling import reference as sampling_ref  # noqa: E402
from h3gen.kernels.sampling import triton as sampling_triton  # noqa: E402
from h3gen.kernels.gemv import triton as gemv_triton  # noqa: E402
from h3gen.kernels.mla_decode import reference as mla_ref  # noqa: E402
from h3gen.kernels.mla_decode import triton as mla_triton  # noqa: E402
from h3gen.kernels.moe import reference as moe_ref  # noqa: E402
from h3gen.kernels.moe import triton as moe_triton  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def _err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("temperature,top_k,top_p,flat", [(0.7, 0, 1.0, False), (1.3, 0, 0.9, False),
                                                          (1.0, 40, 1.0, False), (0.9, 300, 0.95, False),
                                                          (1.0, 0, 0.97, True), (2.0, 4000, 0.5, True)])
def test_draw_token_matches_reference(temperature, top_k, top_p, flat):
    """The one-program draw against the torch composition, token for token over many noise draws: unsorted rows
    (temperature only), top-k with tied logits at the k-th place, top-p cut in a later chunk of a flat row, masked
    (-inf) logits, a width that is no multiple of the chunk."""
    width = 5000
    g = torch.Generator(device=DEVICE).manual_seed(top_k + int(top_p * 100))
    logits = torch.randn(width, generator=g, device=DEVICE) * (0.05 if flat else 3.0)
    logits[7] = logits[8] = logits.max() + 0.5  # a tie at the top
    logits[100:150] = float("-inf")
    sort = top_k > 0 or top_p < 1.0
    values, order = torch.sort(logits, descending=True) if sort else (logits, None)
    if top_k:
        values[top_k - 2 : top_k + 2] = values[top_k - 1]  # ties with the k-th value are kept
    for draw in range(12):
        noise = torch.empty(width, device=DEVICE).exponential_(generator=g)
        got = sampling_triton.draw_token(values, order, noise, temperature, top_k, top_p, block=1024)
        want = sampling_ref.draw_token(values, order, noise, temperature, top_k, top_p)
        assert got.dtype == torch.int64 and torch.equal(got, want), draw
    with pytest.raises(ValueError, match="sorted"):
        sampling_triton.draw_token(logits, None, noise, 1.0, 5, 1.0)


@pytest.mark.parametrize("sort,top_k,top_p", [(False, 0, 1.0), (True, 0, 0.9), (True, 30, 0.95)])
def test_draw_tokens_of_a_batch_match_reference(sort, top_k, top_p):
    """One program per row, every row by the same parameters: each row's token as the reference draws it."""
    g = torch.Generator(device=DEVICE).manual_seed(top_k + 3)
    logits = torch.randn(3, 2100, generator=g, device=DEVICE) * 2.0
    values, order = torch.sort(logits, dim=-1, descending=True) if sort else (logits, None)
    for _ in range(4):
        noise = torch.empty(3, 2100, device=DEVICE).exponential_(generator=g)
        got = sampling_triton.draw_tokens(values, order, noise, 0.8, top_k, top_p, block=512)
        assert got.shape == (3,) and torch.equal(got, sampling_ref.draw_tokens(values, order, noise, 0.8, top_k, top_p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width,block", [(1, 5000, 1024), (3, 777, 256), (2, 300, 512), (5, 4099, 4096)])
def test_argmax_rows_matches_torch(rows, width, block, dtype):
    """First index of the maximum per row, over chunks (the last partial, one chunk when the row fits), with the
    maximum repeated across chunks (the first wins), a NaN (it wins, as in torch) and a row of -inf; twice in a row,
    so the arrival counters are back at zero after each launch."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * 31 + width)
    x = torch.randn(rows, width, generator=g, device=DEVICE).to(dtype)
    top = x.max() + 1
    x[0, width // 3] = top
    x[0, width - 1] = top  # a tie in a later chunk: the earlier index wins
    if rows > 1:
        x[1, width // 2] = float("nan")
        x[1, 0] = float("inf")
    if rows > 2:
        x[2] = float("-inf")
    for _ in range(2):
        got = argmax_triton.argmax_rows(x, block=block)
        assert got.dtype == torch.int64 and torch.equal(got, argmax_ref.argmax_rows(x))
    with pytest.raises(ValueError, match="empty"):
        argmax_triton.argmax_rows(x[:, :0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n,k,block_k", [(1, 37, 300, None), (3, 64, 96, 32), (4, 130, 17, None),
                                              (2, 5, 2100, 512)])  # 2100 over 512: five K steps, the last partial
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
@pytest.mark.parametrize("rows,n,k,add", [(1, 37, 300, True), (2, 64, 96, False), (3, 130, 17, True),
                                          (4, 5, 2048, True), (1, 9, 2048, False)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 70), (3, 5, 200), (4, 33)])
def test_rms_norm_alone_and_after_a_residual_add_matches_reference(shape, dtype):
    from h3gen.kernels.rmsnorm import reference as norm_ref
    from h3gen.kernels.rmsnorm import triton as norm_triton

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,experts,inter,width", [(1, 6, 8, 48, 70), (3, 2, 5, 300, 33), (2, 1, 3, 17, 130),
                                                         (2, 8, 9, 600, 24)])  # 2 x 8 slots: three K steps
def test_decode_expert_chain_matches_reference(tokens, top_k, experts, inter, width, dtype):
    """Router logits, the up/gate GEMV reading each token's row for its k slots, and the fused SwiGLU + down GEMV +
    weighted slot sum, each against its reference and together against the plain per-pair computation."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens * 7 + inter)
    h = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    router = torch.randn(experts, width, generator=g, device=DEVICE)  # float32, as K3 keeps it
    logits = moe_triton.router_logits(h, router)
    assert logits.dtype == torch.float32 and _err(logits, moe_ref.router_logits(h, router)) <= 1e-5
    up_gate = torch.randn(experts, 2 * inter, width, generator=g, device=DEVICE).to(dtype) / width**0.5
    down = torch.randn(experts, width, inter, generator=g, device=DEVICE).to(dtype) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    both = moe_triton.expert_gemv(h, up_gate, ids.reshape(-1), top_k)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert both.shape == (tokens * top_k, 2 * inter)
    assert _err(both, moe_ref.expert_gemv(h.float(), up_gate.float(), ids.reshape(-1), top_k)) <= tolerance
    out = moe_triton.expert_swiglu_down(both, down, ids, weights)
    assert out.shape == (tokens, width) and out.dtype == dtype
    assert _err(out, moe_ref.expert_swiglu_down(both, down, ids, weights)) <= tolerance
    base = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)  # another output to add (shared expert)
    summed = moe_triton.expert_swiglu_down(both, down, ids, weights, add=base)
    assert _err(summed, moe_ref.expert_swiglu_down(both, down, ids, weights, base)) <= tolerance
    assert _err(summed, out.double() + base.double()) <= 2 * tolerance
    plain = torch.zeros(tokens, width, dtype=torch.float64, device=DEVICE)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            up, gate = (up_gate[e].double() @ h[t].double()).chunk(2)
            plain[t] += weights[t, j].double() * (down[e].double() @ (up * torch.sigmoid(gate) * gate))
    assert _err(out, plain) <= (1e-5 if dtype == torch.float32 else 1e-2)


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
@pytest.mark.parametrize("batch,heads,nope,rope,rank,v_dim", [(1, 3, 16, 8, 40, 16), (3, 2, 24, 5, 160, 20),
                                                             (6, 2, 8, 4, 48, 12)])
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


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,dim,width,lower_bound,parts", [
    (3, 16, 4, None, 1), (2, 32, 3, -5.0, 4), (5, 8, 4, -5.0, None), (2, 24, 4, None, 4), (3, 16, 4, None, 16)])
def test_fused_kda_decode_matches_reference(heads, dim, width, lower_bound, dtype, parts):
    from h3gen.kernels.kda import reference as kda_ref
    from h3gen.kernels.kda import triton as kda_triton

    g = torch.Generator(device=DEVICE).manual_seed(heads * dim + width)
    batch, hd = 2, heads * dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)

    # q, k, v, b as column slices of one fused projection (as the model passes them), f and gate on their own.
    fused = rand(batch, 3 * hd + heads + 5)
    q, k, v, b = fused[:, :hd], fused[:, hd : 2 * hd], fused[:, 2 * hd : 3 * hd], fused[:, 3 * hd : 3 * hd + heads]
    f, gate = rand(batch, hd), rand(batch, hd)
    conv_weights = [torch.randn(hd, 1, width, generator=g, device=DEVICE) * 0.5 for _ in range(3)]
    a_log = torch.rand(heads, generator=g, device=DEVICE) * 2.0
    dt_bias = torch.randn(hd, generator=g, device=DEVICE) * 0.5
    norm_weight = (1.0 + 0.1 * torch.randn(dim, generator=g, device=DEVICE)).to(dtype)
    # States as the pool holds them: views into per-sequence rows that hold other layers' states too.
    rows = torch.randn(batch, 3, (width - 1) * 3 * hd + heads * dim * dim, generator=g, device=DEVICE)
    conv_state = rows[:, 1, : (width - 1) * 3 * hd].view(batch, width - 1, 3 * hd)
    state = rows[:, 1, (width - 1) * 3 * hd :].view(batch, heads, dim, dim)
    expected_conv, expected_state = conv_state.clone(), state.clone()
    start = rows.clone()
    args = (f, a_log, dt_bias, lower_bound, b, gate, norm_weight, 1e-5)
    expected = kda_ref.kda_decode(q, k, v, conv_weights, expected_conv, *args, expected_state, dim ** -0.5)
    untouched = rows[:, 0].clone()
    got = kda_triton.kda_decode(q, k, v, conv_weights, conv_state, *args, state, dim ** -0.5, parts=parts)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert got.shape == (batch, hd) and got.dtype == dtype
    assert _err(got, expected) <= tolerance
    assert _err(state, expected_state) <= 1e-5 and torch.equal(conv_state, expected_conv)
    assert torch.equal(rows[:, 0], untouched)  # the neighbouring layer's state is left alone
    # The states where they lie in a pool of five slots, picked by row indices (a decode graph's layout).
    pool = torch.randn(5, 3, rows.shape[-1], generator=g, device=DEVICE)
    picked = torch.tensor([3, 0], device=DEVICE)
    pool[picked, 1] = start[:, 1]
    pool_conv = pool[:, 1, : (width - 1) * 3 * hd].view(5, width - 1, 3 * hd)
    pool_state = pool[:, 1, (width - 1) * 3 * hd :].view(5, heads, dim, dim)
    before = pool.clone()
    got = kda_triton.kda_decode(q, k, v, conv_weights, pool_conv, *args, pool_state, dim ** -0.5, rows=picked,
                                parts=parts)
    assert _err(got, expected) <= tolerance
    assert _err(pool_state[picked], expected_state) <= 1e-5 and torch.equal(pool_conv[picked], expected_conv)
    others = [1, 2, 4]
    assert torch.equal(pool[others], before[others]) and torch.equal(pool[:, 0], before[:, 0])
    via_ref = before.clone()  # the reference with rows gathers, computes and writes back the same
    ref_conv = via_ref[:, 1, : (width - 1) * 3 * hd].view(5, width - 1, 3 * hd)
    ref_state = via_ref[:, 1, (width - 1) * 3 * hd :].view(5, heads, dim, dim)
    ref_out = kda_ref.kda_decode(q, k, v, conv_weights, ref_conv, *args, ref_state, dim ** -0.5, rows=picked)
    assert _err(ref_out, expected) <= 1e-6 and _err(via_ref, pool) <= 1e-5
    from h3gen.kernels._arrivals import arrival_counters

    assert not arrival_counters(q.device, "kda_decode", 1).any()  # every head's last part reset its counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,dim,rank,width,parts", [(3, 16, 12, 4, 1), (2, 64, 24, 3, 4), (2, 24, 16, 4, 2),
                                                         (2, 32, 16, 4, 4), (3, 8, 12, 2, 1)])
def test_fused_kda_decode_with_low_rank_gates(heads, dim, rank, width, parts, dtype):
    """`gate_up`: the decay and output gates projected up from their low-rank inputs inside the kernel (a rank that
    is no power of two, a head width below its block, one part and several) equal the reference that runs the two
    linears first, and the same kernel fed the projected gates; the states move the same way."""
    from h3gen.kernels.kda import reference as kda_ref
    from h3gen.kernels.kda import triton as kda_triton

    g = torch.Generator(device=DEVICE).manual_seed(heads * dim + rank)
    batch, hd = 2, heads * dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)

    # q, k, v, b and the two low-rank inputs as column slices of one fused projection, as the model passes them.
    fused = rand(batch, 3 * hd + heads + 2 * rank)
    q, k, v, b = fused[:, :hd], fused[:, hd : 2 * hd], fused[:, 2 * hd : 3 * hd], fused[:, 3 * hd : 3 * hd + heads]
    f_a, g_a = fused[:, 3 * hd + heads : 3 * hd + heads + rank], fused[:, 3 * hd + heads + rank :]
    gate_up = rand(2, hd, rank, scale=rank ** -0.5)
    conv_weights = [torch.randn(hd, 1, width, generator=g, device=DEVICE) * 0.5 for _ in range(3)]
    a_log = torch.rand(heads, generator=g, device=DEVICE) * 2.0
    dt_bias = torch.randn(hd, generator=g, device=DEVICE) * 0.5
    norm_weight = (1.0 + 0.1 * torch.randn(dim, generator=g, device=DEVICE)).to(dtype)
    conv_state = torch.randn(batch, width - 1, 3 * hd, generator=g, device=DEVICE)
    state = torch.randn(batch, heads, dim, dim, generator=g, device=DEVICE)
    states = {name: (conv_state.clone(), state.clone()) for name in ("reference", "low rank", "projected")}

    def run(name, fn, f, gate, **extra):
        conv, recurrent = states[name]
        return fn(q, k, v, conv_weights, conv, f, a_log, dt_bias, -5.0, b, gate, norm_weight, 1e-5, recurrent,
                  dim ** -0.5, **extra)

    expected = run("reference", kda_ref.kda_decode, f_a, g_a, gate_up=gate_up)
    got = run("low rank", kda_triton.kda_decode, f_a, g_a, gate_up=gate_up, parts=parts)
    projected = run("projected", kda_triton.kda_decode, torch.nn.functional.linear(f_a, gate_up[0]),
                    torch.nn.functional.linear(g_a, gate_up[1]), parts=parts)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(got, expected) <= tolerance and _err(got, projected) <= tolerance
    for name in ("low rank", "projected"):
        assert torch.equal(states[name][0], states["reference"][0])  # the conv states shift the same
        assert _err(states[name][1], states["reference"][1]) <= 1e-5
    assert not torch.equal(states["reference"][0], conv_state)
    with pytest.raises(ValueError, match="gate_up"):
        run("low rank", kda_triton.kda_decode, f_a, g_a, gate_up=gate_up[:, :, 1:])


def test_kda_decode_default_parts():
    from h3gen.kernels.kda.triton import default_parts

    assert default_parts(1, 16, 128) == 8 and default_parts(2, 16, 128) == 4 and default_parts(4, 16, 128) == 2
    assert default_parts(8, 16, 128) == 1
    assert default_parts(1, 2, 32) == 2 and default_parts(1, 2, 16) == 1  # never parts under 16 columns


@pytest.mark.parametrize("tokens,experts,top_k,bias,renormalize,always", [
    (1, 64, 6, True, True, 0), (5, 37, 3, False, True, 1), (9, 8, 2, True, False, 2), (3, 64, 6, True, True, 1),
    (2, 896, 16, True, True, 1), (3, 200, 8, False, False, 0)])
def test_route_topk_matches_reference(tokens, experts, top_k, bias, renormalize, always):
    g = torch.Generator(device=DEVICE).manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    correction = torch.randn(experts, generator=g, device=DEVICE) * 0.1 if bias else None
    expected_w, expected_ids = moe_ref.route_topk(logits, correction, top_k, renormalize=renormalize, scaling=2.5,
                                                  always=always)
    got_w, got_ids = moe_triton.route_topk(logits, correction, top_k, renormalize, 2.5, always)
    assert got_ids.shape == (tokens, top_k + always) and torch.equal(got_ids, expected_ids)
    assert _err(got_w, expected_w) <= 1e-6
    # the always-on experts follow the routed ones, unscaled, and leave the routed weights as they were
    assert torch.equal(got_ids[:, top_k:], torch.arange(experts, experts + always, device=DEVICE).expand(tokens, -1))
    assert torch.equal(got_w[:, top_k:], torch.ones(tokens, always, device=DEVICE))
    plain_w, plain_ids = moe_ref.route_topk(logits, correction, top_k, renormalize=renormalize, scaling=2.5)
    assert torch.equal(got_ids[:, :top_k], plain_ids) and _err(got_w[:, :top_k], plain_w) <= 1e-6


@pytest.mark.parametrize("shape,width,dtype", [((1, 1), 64, torch.float32), ((3, 1), 1500, torch.float16),
                                               ((2, 5), 33, torch.float32)])
def test_embedding_rows_matches_reference(shape, width, dtype):
    """The decode step's embedding lookup: exact rows for ids anywhere in the table (the last row included), widths
    that are no multiple of the block; an id outside the table gives zeros, not other memory."""
    from h3gen.kernels.embedding import reference as emb_ref
    from h3gen.kernels.embedding import triton as emb_triton

    g = torch.Generator(device=DEVICE).manual_seed(width)
    table = torch.randn(50, width, generator=g, device=DEVICE).to(dtype)
    ids = torch.randint(0, 50, shape, generator=g, device=DEVICE)
    ids.view(-1)[0] = 49
    got = emb_triton.embedding_rows(ids, table, block=32)
    assert got.shape == (*shape, width) and torch.equal(got, emb_ref.embedding_rows(ids, table))
    ids.view(-1)[-1] = 50
    assert not emb_triton.embedding_rows(ids, table).view(-1, width)[-1].any()


@pytest.mark.parametrize("experts,top_k", [(64, 6), (37, 5), (300, 7)])
def test_route_topk_breaks_ties_by_lower_index(experts, top_k):
    """Tied scores (logits on a coarse grid, one value shared by many experts) are taken in index order, as a
    stable descending sort orders them: both the all-at-once ranking (up to 128 experts) and the repeated max."""
    g = torch.Generator(device=DEVICE).manual_seed(experts)
    logits = torch.randint(-2, 3, (4, experts), generator=g, device=DEVICE).float() * 0.5
    logits[1] = 0.0  # every expert tied
    logits[2, -3:] = 4.0  # a tie at the top, at the end of the row
    _, got_ids = moe_triton.route_topk(logits, None, top_k, True, 1.0)
    expected = torch.sort(logits.sigmoid(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(got_ids, expected)


@pytest.mark.parametrize("always,block_k", [(1, None), (2, 16)])
def test_expert_gemv_with_always_on_slots_matches_reference(always, block_k):
    """Always-on slots (the last of each token's, experts stacked after the routed ones) take their expert from
    their slot, not from the ids: the same output as the reference reading the ids (two K steps with block_k 16)."""
    g = torch.Generator(device=DEVICE).manual_seed(always)
    tokens, routed, experts, n, k = 3, 2, 5, 12, 24
    x = torch.randn(tokens, k, generator=g, device=DEVICE)
    weight = torch.randn(experts + always, n, k, generator=g, device=DEVICE)
    chosen = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:routed]
                          for t in range(tokens)]).to(DEVICE)
    ids = torch.cat([chosen, torch.arange(experts, experts + always, device=DEVICE).expand(tokens, -1)], dim=1)
    top_k = routed + always
    got = moe_triton.expert_gemv(x, weight, ids.reshape(-1), top_k, block_k=block_k, always=always,
                                   early=True)
    assert _err(got, moe_ref.expert_gemv(x, weight, ids.reshape(-1), top_k)) <= 1e-6
    with pytest.raises(ValueError, match="always-on"):
        moe_triton.expert_gemv(x, weight, ids.reshape(-1), top_k, always=top_k + 1)


@pytest.mark.parametrize("ahead", [0, 2, 3, 4])
def test_expert_tail_with_k_steps_loaded_ahead_matches_reference(ahead):
    """The SwiGLU + down tail with 0 to 4 of its K steps' weights loaded before the wait: the same sums (five K
    steps of 128 here, so the loop still runs after the steps loaded ahead, and ahead steps past the end masked)."""
    g = torch.Generator(device=DEVICE).manual_seed(ahead)
    tokens, top_k, experts, inter, width = 2, 3, 5, 600, 24
    both = torch.randn(tokens * top_k, 2 * inter, generator=g, device=DEVICE)
    down = torch.randn(experts, width, inter, generator=g, device=DEVICE) / inter ** 0.5
    ids = torch.tensor([[0, 3, 4], [2, 1, 3]], device=DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    expected = moe_ref.expert_swiglu_down(both, down, ids, weights)
    got = moe_triton.expert_swiglu_down(both, down, ids, weights, block_k=128, ahead=ahead)
    assert _err(got, expected) <= 1e-5
    short = moe_triton.expert_swiglu_down(both, down, ids, weights, block_k=512, ahead=ahead)  # 2 steps
    assert _err(short, expected) <= 1e-5
    with pytest.raises(ValueError, match="K steps ahead"):
        moe_triton.expert_swiglu_down(both, down, ids, weights, ahead=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,width,top_k,always,bias", [
    (1, 64, 128, 6, 1, True), (3, 37, 40, 3, 0, False), (5, 8, 33, 2, 2, True)])
def test_router_topk_matches_router_then_topk(tokens, experts, width, top_k, always, bias, dtype):
    """The fused router + top-k (and its residual-update + norm prologue) against the separate reference ops; the
    token's last program routes it and sets its arrival counter back to zero."""
    from h3gen.kernels._arrivals import arrival_counters
    from h3gen.kernels.rmsnorm import reference as norm_ref

    g = torch.Generator(device=DEVICE).manual_seed(tokens * experts + width)
    x = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    delta = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    router = torch.randn(experts, width, generator=g, device=DEVICE) / width ** 0.5  # float32, as K3 keeps it
    norm_weight = (1.0 + 0.1 * torch.randn(width, generator=g, device=DEVICE)).to(dtype)
    correction = torch.randn(experts, generator=g, device=DEVICE) * 0.1 if bias else None
    route = (correction, top_k, True, 2.5, always)

    def expected(rows):
        return moe_ref.route_topk(moe_ref.router_logits(rows, router), correction, top_k, renormalize=True,
                                  scaling=2.5, always=always)

    got_w, got_ids = moe_triton.router_topk(x, router, *route)
    want_w, want_ids = expected(x)
    assert torch.equal(got_ids, want_ids) and _err(got_w, want_w) <= 1e-6
    total, normed, got_w, got_ids = moe_triton.router_topk(x, router, *route, residual=(delta, norm_weight, 1e-6))
    want_total, want_normed = norm_ref.add_rms_norm(x, delta, norm_weight, 1e-6)
    want_w, want_ids = expected(want_normed)
    assert torch.equal(total, want_total) and normed.dtype == want_normed.dtype
    assert _err(normed, want_normed) <= (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(got_ids, want_ids) and _err(got_w, want_w) <= 1e-6
    assert not arrival_counters(x.device, "router_topk", 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,inter,width",
                         [(37, 5, 2, 24, 40), (3, 9, 3, 16, 33), (70, 4, 1, 20, 16)])
def test_grouped_expert_gemm_matches_per_expert_reference(tokens, experts, top_k, inter, width, dtype):
    """The prefill MoE path: pairs grouped into expert blocks on the device, [up; gate] GEMM with SwiGLU fused, then
    the down GEMM, against the per-expert grouped reference."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens + experts)
    h = torch.randn(tokens, width, generator=g, device=DEVICE).to(dtype)
    up_gate = (torch.randn(experts, 2 * inter, width, generator=g, device=DEVICE) / width ** 0.5).to(dtype)
    down = (torch.randn(experts, width, inter, generator=g, device=DEVICE) / inter ** 0.5).to(dtype)
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=g, device=DEVICE)  # the last expert gets none
    pairs = ids.reshape(-1)
    rows, block_expert = moe_triton.moe_blocks(pairs, experts, 16)
    act = moe_triton.grouped_expert_gemm(h, up_gate, rows, block_expert, pairs.numel(), top_k, swiglu=True,
                                         block_m=16, block_n=16, block_k=16)
    out = moe_triton.grouped_expert_gemm(act, down, rows, block_expert, pairs.numel(), 1, block_m=16, block_n=16,
                                         block_k=16)
    order, offsets = moe_ref.sort_by_expert(ids, experts)
    inputs = h.float()[order // top_k]
    both = moe_ref.grouped_gemm(inputs, offsets, list(up_gate.float()))
    expected_act = both[:, :inter] * torch.nn.functional.silu(both[:, inter:])
    expected = moe_ref.grouped_gemm(expected_act, offsets, list(down.float()))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(act[order], expected_act) <= tolerance
    assert _err(out[order], expected) <= tolerance
    # Every pair sits in exactly one block of its own expert.
    placed = rows[rows >= 0]
    assert sorted(placed.tolist()) == list(range(pairs.numel()))
    block_of = torch.nonzero(rows.view(-1, 16) >= 0)[:, 0]
    assert torch.equal(block_expert[block_of], pairs[placed])


@pytest.mark.parametrize("tokens,top_k,experts,n,k", [(1, 1, 3, 37, 64), (3, 2, 5, 20, 40), (2, 2, 2, 48, 300),
                                                       (1, 6, 8, 16, 520)])
def test_mxfp4_expert_gemv_matches_reference(tokens, top_k, experts, n, k):
    """Each (token, slot) pair through its MXFP4 expert, reading the token's row (odd widths end inside a group of
    32; 520 spans three 256-wide steps), against the dequantized per-pair product."""
    from h3gen.quant.mxfp4_format import quantize

    g = torch.Generator(device=DEVICE).manual_seed(tokens * n + k)
    weights = [torch.randn(n, k, generator=g, device=DEVICE) for _ in range(experts)]
    packed, scales = (torch.stack(parts) for parts in zip(*(quantize(w) for w in weights)))
    x = torch.randn(tokens, k, generator=g, device=DEVICE)
    ids = torch.randint(0, experts, (tokens * top_k,), generator=g, device=DEVICE)
    expected = moe_ref.expert_gemv_mxfp4(x, packed, scales, ids, top_k)
    got = moe_triton.expert_gemv_mxfp4(x, packed, scales, ids, top_k)
    assert got.shape == (tokens * top_k, n)
    assert _err(got, expected) <= 1e-5
    pair = tokens * top_k - 1
    direct = moe_ref.dequantize(packed[ids[pair]], scales[ids[pair]], torch.float64, k) @ x[pair // top_k].double()
    assert _err(got[pair], direct) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,top_k,experts,inter,width", [(1, 6, 8, 48, 70), (3, 2, 5, 300, 33), (2, 1, 3, 17, 130),
                                                         (10, 3, 6, 80, 40)])  # 10 tokens: the slot loop
def test_mxfp4_decode_expert_tail_matches_reference(tokens, top_k, experts, inter, width, dtype):
    """SwiGLU, the MXFP4 down experts and the weighted slot sum in one kernel, against the reference and against the
    plain per-pair computation over the dequantized experts."""
    from h3gen.quant.mxfp4_format import dequantize, quantize

    g = torch.Generator(device=DEVICE).manual_seed(tokens * 13 + inter)
    down = [torch.randn(width, inter, generator=g, device=DEVICE) / inter**0.5 for _ in range(experts)]
    packed, scales = (torch.stack(parts) for parts in zip(*(quantize(w) for w in down)))
    both = torch.randn(tokens * top_k, 2 * inter, generator=g, device=DEVICE).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=g, device=DEVICE)
    out = moe_triton.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)
    assert out.shape == (tokens, width) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert _err(out, moe_ref.expert_swiglu_down_mxfp4(both, packed, scales, ids, weights)) <= tolerance
    plain = torch.zeros(tokens, width, dtype=torch.float64, device=DEVICE)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            up, gate = both[t * top_k + j].double().chunk(2)
            weight = dequantize(packed[e], scales[e], torch.float64, inter)
            plain[t] += weights[t, j].double() * (weight @ (up * torch.sigmoid(gate) * gate))
    assert _err(out, plain) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_word_decoding_covers_every_code_and_scale_edge():
    """Every E2M1 code at every position of a word, tiny, unit and huge scales, and NaN scales, through the
    word-decoding expert GEMV against float64 (activations are powers of two, so every product is exact)."""
    from h3gen.quant.mxfp4_format import dequantize

    n, k = 5, 64
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()[None]  # low nibble = even element
    scales = torch.tensor([[1, 127], [100, 130], [180, 60], [0, 3], [255, 127]], dtype=torch.uint8)[None]
    x = torch.tensor([2.0 ** (i % 5 - 2) for i in range(k)])[None]
    ids = torch.zeros(1, dtype=torch.long)
    got = moe_triton.expert_gemv_mxfp4(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE)).cpu()
    expected = dequantize(packed[0], scales[0], torch.float64, k) @ x[0].double()
    assert torch.isnan(got[0, 4]) and torch.isnan(expected[4])
    assert torch.allclose(got[0, :4].double(), expected[:4], rtol=1e-6, atol=0)
    assert 0 < abs(got[0, 3]) < 1e-30  # a row of the smallest scales keeps its (tiny) value


def test_programmatic_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL launch options: never for CPU tensors (nor under the interpreter), switched off by H3GEN_PDL=0, and on
    a GPU only from compute capability 9.0."""
    from h3gen.kernels import _pdl

    assert _pdl.pdl_launch(torch.zeros(1)) == {} and not _pdl.pdl_flag({})
    if ON_GPU:
        expected = {"launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}
        assert _pdl.pdl_launch(torch.zeros(1, device="cuda")) == expected
        monkeypatch.setenv("H3GEN_PDL", "0")
        assert _pdl.pdl_launch(torch.zeros(1, device="cuda")) == {}
    assert _pdl.pdl_flag({"launch_pdl": True})


def _prefill_and_decode(model, monkeypatch, triton: str) -> torch.Tensor:
    """Logits `[3, vocab]` of a five-token prefill and two greedy decode steps, with `H3GEN_TRITON=triton`; each
    step's argmax as the model returns it with its logits (on the Triton path, found by lm_head's kernel) is the
    logits' argmax."""
    monkeypatch.setenv("H3GEN_TRITON", triton)
    cache = model.new_cache()
    logits = [model(torch.tensor([[3, 7, 11, 5, 9]], device=DEVICE), cache)[:, -1]]
    for _ in range(2):
        step, argmax = model(logits[-1].argmax(-1)[:, None], cache, with_argmax=True)
        assert argmax.shape == (1, 1) and torch.equal(argmax, step.argmax(-1))
        logits.append(step[:, -1])
    return torch.cat(logits)


def test_tiny_decode_through_the_triton_kernels_matches_torch(monkeypatch):
    """The tiny K3 (residual stream, stacked experts with the shared one riding as expert E, fused projections)
    prefilled and decoded two steps on the Triton kernels gives the torch path's logits; a decode step's norms are
    computed in its projections' kernels (`normed_rows_linear`: with a residual add into every layer's input
    projection, the dense MLP's and lm_head; without one for the embeddings and MLA's q_a)."""
    import dataclasses

    from h3gen.pipelines.k3.config import K3Config
    from h3gen.pipelines.k3.engine.graphs import prepare_for_decode
    from h3gen.pipelines.k3.model import K3ForCausalLM
    from h3gen.pipelines.k3.demo_model import randomize, tiny_config

    config = dataclasses.replace(K3Config.from_dict(tiny_config()), experts_mxfp4=False, attn_res_block_size=0)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=DEVICE), seed=5).float().eval()
    prepare_for_decode(model)
    normed_calls = []
    kernel = gemv_triton.normed_rows_linear
    monkeypatch.setattr(gemv_triton, "normed_rows_linear",
                        lambda *args, **kw: normed_calls.append(args[4] is not None) or kernel(*args, **kw))

    with torch.no_grad():
        expected = _prefill_and_decode(model, monkeypatch, "0")
        assert not normed_calls
        got = _prefill_and_decode(model, monkeypatch, "1")
    assert _err(got, expected) <= 1e-5
    layers = config.num_hidden_layers
    mla = config.attention_types.count("mla")
    # per decode step: the layers' ends (into the next input projection or lm_head) and the dense layer's
    # post-attention norm with a residual; the embeddings' norm and each MLA layer's q_a norm without
    assert normed_calls.count(True) == 2 * (layers + config.ffn_types.count("dense"))
    assert normed_calls.count(False) == 2 * (1 + mla)


def test_silu_model_decode_through_the_triton_kernels_matches_torch(monkeypatch):
    """A tiny K3 with SwiGLU experts at full width (the mid-size benchmark's kind: the shared expert rides in the
    stack; the ids' embeddings come from the embedding kernel) prefilled and decoded two steps on the Triton
    kernels gives the torch path's logits."""
    import dataclasses

    from h3gen.kernels.embedding import triton as emb_triton
    from h3gen.pipelines.k3.config import K3Config
    from h3gen.pipelines.k3.engine.graphs import prepare_for_decode
    from h3gen.pipelines.k3.model import K3ForCausalLM
    from h3gen.pipelines.k3.demo_model import randomize, tiny_config

    config = dataclasses.replace(K3Config.from_dict(tiny_config()), experts_mxfp4=False, attn_res_block_size=0,
                                 hidden_act="silu", routed_expert_hidden_size=None, latent_moe_use_norm=False)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=DEVICE), seed=6).float().eval()
    prepare_for_decode(model)
    calls = []
    for module, name in ((emb_triton, "embedding_rows"),):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))

    with torch.no_grad():
        expected = _prefill_and_decode(model, monkeypatch, "0")
        assert not calls
        got = _prefill_and_decode(model, monkeypatch, "1")
    assert _err(got, expected) <= 1e-5
    assert calls == ["embedding_rows"] * 3  # the prompt's five ids and each step's one
