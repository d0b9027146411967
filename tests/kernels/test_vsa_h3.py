"""VSA-H3 attention: the tile geometry against a hand enumeration, the selection's k and prefix exemption, the torch
reference against a per-row computation written here, the Triton kernel (interpreter on the CPU) against the
reference, the dense cases equal to the attention dispatch bit for bit, and the errors."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.kernel_cases import DEVICE, DTYPES, ON_GPU, assert_same_fp8
from helpers.kernel_cases import case as _case
from helpers.kernel_cases import err as _err
from helpers.kernel_cases import rand as _rand

from h3gen.kernels.attention import attention
from h3gen.kernels.vsa_h3 import (
    build_tile_geometry,
    kept_video_tiles,
    resolve_backend,
    select_tiles,
    selection_map,
    tile_means,
    tile_scores,
    vsa_h3_attention,
)
from h3gen.kernels.vsa_h3 import reference as vsa_ref

ROOT = Path(__file__).resolve().parents[2]

# (prefix segments, video grid): segments shorter than 64, empty ones, remainders after full chunks; grids with a
# partial tile on every axis, and one whose grid divides evenly.
SHAPES = [
    ((5, 0, 70), (5, 6, 9)),
    ((130,), (3, 5, 4)),
    ((0, 17, 64), (4, 8, 8)),
    ((), (6, 3, 5)),
]


def _expected_layout(prefix, grid):
    """Row -> (tile, slot in tile) and each tile's size, enumerated by hand."""
    tiles, sizes, row = [], [], 0
    for length in prefix:
        for start in range(0, length, 64):
            size = min(64, length - start)
            tiles += [(len(sizes), i) for i in range(size)]
            sizes.append(size)
            row += size
    t, h, w = grid
    first_video = len(sizes)
    video = {}
    for a in range(0, t, 4):
        for b in range(0, h, 4):
            for c in range(0, w, 4):
                inside = 0
                for i in range(a, min(a + 4, t)):
                    for j in range(b, min(b + 4, h)):
                        for k in range(c, min(c + 4, w)):
                            video[(i * h + j) * w + k] = (len(sizes), inside)
                            inside += 1
                sizes.append(inside)
    tiles += [video[r] for r in range(t * h * w)]
    return tiles, sizes, first_video


def _inputs(prefix, grid, heads, dim, dtype, seed, batch=2, gate=True):
    geometry = build_tile_geometry(prefix, grid).to(DEVICE)
    g = _case(seed)
    shape = (batch, geometry.num_rows, heads, dim)
    q, k, v = (_rand(*shape, dtype=dtype, generator=g) for _ in range(3))
    return geometry, q, k, v, (_rand(*shape, dtype=dtype, generator=g) if gate else None)


# -- geometry ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix, grid", SHAPES)
def test_geometry_matches_hand_enumeration(prefix, grid):
    geometry = build_tile_geometry(prefix, grid, num_rows=sum(prefix) + math.prod(grid))
    tiles, sizes, first_video = _expected_layout(prefix, grid)
    assert geometry.num_tiles == len(sizes) and geometry.num_prefix_tiles == first_video
    assert geometry.num_video_tiles == len(sizes) - first_video
    assert geometry.tile_sizes.dtype == torch.int32 and geometry.tile_sizes.tolist() == sizes
    assert geometry.untile_index.tolist() == [64 * tile + slot for tile, slot in tiles]
    assert geometry.row_tile.tolist() == [tile for tile, _ in tiles]
    assert geometry.gather_index[geometry.untile_index].tolist() == list(range(geometry.num_rows))
    assert (geometry.gather_index[geometry.pad_slots] == geometry.num_rows).all()
    assert geometry.pad_slots.numel() == 64 * len(sizes) - geometry.num_rows


@pytest.mark.parametrize("prefix, grid", SHAPES)
def test_tile_then_untile_round_trips_with_zero_padding(prefix, grid):
    geometry = build_tile_geometry(prefix, grid)
    x = torch.randn(2, geometry.num_rows, 3, 8) + 5.0
    slots = geometry.tile(x)
    assert slots.shape == (2, geometry.num_tiles * 64, 3, 8)
    assert torch.equal(geometry.untile(slots), x)
    assert not slots[:, geometry.pad_slots].any()
    assert (slots.abs().sum((0, 2, 3)) > 0).sum() == geometry.num_rows


def test_geometry_of_the_5s_768p_request():
    # 124 frames at 768x1344: (37, 24, 42) -> 660 video tiles, 414 audio rows -> 7 tiles
    geometry = build_tile_geometry((128, 0, 414), (37, 24, 42), num_rows=37838)
    assert (geometry.num_prefix_tiles, geometry.num_video_tiles) == (2 + 7, 660)
    assert kept_video_tiles(0.9, geometry.num_video_tiles) == 66
    # t = 37 leaves one-frame tiles in the last tile row; w = 42 leaves 2-wide tiles in the last column
    assert geometry.tile_sizes[-1].item() == 1 * 4 * 2 and geometry.tile_sizes[9].item() == 64


def test_geometry_without_video_is_all_prefix():
    geometry = build_tile_geometry((10, 70), None, num_rows=80)
    assert (geometry.num_tiles, geometry.num_prefix_tiles, geometry.num_video_tiles) == (3, 3, 0)
    assert geometry.tile_sizes.tolist() == [10, 64, 6]


@pytest.mark.parametrize(
    "prefix, grid, rows, match",
    [((5, 7), (2, 2, 2), 21, "add up to 20"), ((5, -1), (2, 2, 2), None, "non-negative"), ((), (2, 2), None, "three")],
)
def test_geometry_refuses_bad_segments(prefix, grid, rows, match):
    with pytest.raises(ValueError, match=match):
        build_tile_geometry(prefix, grid, num_rows=rows)


# -- selection ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sparsity, tiles, k",
    [(0.9, 660, 66), (0.9, 1188, 119), (0.9, 1716, 172), (0.0, 10, 10), (0.99, 10, 1), (0.5, 3, 2)],
)
def test_kept_video_tiles(sparsity, tiles, k):
    assert kept_video_tiles(sparsity, tiles) == k


def test_tile_means_divide_by_valid_rows():
    geometry = build_tile_geometry((5, 70), (5, 6, 9))
    x = torch.randn(2, geometry.num_rows, 3, 8)
    means = tile_means(geometry.tile(x), geometry)
    assert means.shape == (2, 3, geometry.num_tiles, 8) and means.dtype == torch.float32
    for tile in range(geometry.num_tiles):
        rows = (geometry.row_tile == tile).nonzero().reshape(-1)
        torch.testing.assert_close(means[:, :, tile], x[:, rows].mean(1), rtol=1e-6, atol=1e-6)


def test_selection_keeps_prefix_keys_and_top_video_tiles_per_head():
    geometry = build_tile_geometry((5, 0, 70, 13), (5, 6, 9))  # 4 prefix tiles, 12 video tiles
    p, v, t = geometry.num_prefix_tiles, geometry.num_video_tiles, geometry.num_tiles
    scores = torch.randn(2, 3, t, t, generator=torch.Generator().manual_seed(1))
    selection = select_tiles(scores, geometry, 0.6)
    k = kept_video_tiles(0.6, v)
    assert (p, v, k) == (4, 12, 5)
    assert selection.q2k_idx.dtype == selection.q2k_num.dtype == torch.int32
    assert selection.q2k_idx.shape == (2, 3, v, p + k) and (selection.q2k_num == p + k).all()
    assert (selection.q2k_idx.diff(dim=-1) > 0).all()  # ascending
    tile_map = selection_map(selection)
    assert tile_map[:, :, :p].all()  # prefix query tiles dense
    assert tile_map[:, :, :, :p].all()  # prefix key tiles exempt
    for b in range(2):
        for h in range(3):
            for i in range(p, t):
                top = sorted(range(p, t), key=lambda j, b=b, h=h, i=i: -scores[b, h, i, j].item())[:k]
                assert tile_map[b, h, i, p:].nonzero().reshape(-1).add(p).tolist() == sorted(top)
    assert not torch.equal(tile_map[:, 0], tile_map[:, 1])  # chosen per head


def test_selection_follows_the_scores_of_each_head():
    geometry = build_tile_geometry((64,), (4, 4, 12))  # 1 prefix tile, then video tiles 1, 2, 3 along w
    q = torch.zeros(1, geometry.num_rows, 2, 4)
    k = torch.zeros(1, geometry.num_rows, 2, 4)
    q[..., 0] = 1.0
    video_tile = torch.arange(geometry.num_rows - 64) % 12 // 4  # 0, 1, 2 along w
    k[:, 64:, 0, 0] = video_tile.float()  # head 0 prefers the last video tiles
    k[:, 64:, 1, 0] = -video_tile.float()  # head 1 the first ones
    scores = tile_scores(tile_means(geometry.tile(q), geometry), tile_means(geometry.tile(k), geometry))
    selection = select_tiles(scores, geometry, 0.5)  # k = 2 of 3
    assert selection.q2k_idx[0, 0].tolist() == [[0, 2, 3]] * 3
    assert selection.q2k_idx[0, 1].tolist() == [[0, 1, 2]] * 3


# -- reference ---------------------------------------------------------------------------------------------------


def _brute_force(q, k, v, gate, prefix, grid, sparsity):
    """VSA-H3 row by row in float64 from the hand enumeration: means, scores, top-k, masked softmax, gate branch."""
    tiles, sizes, p = _expected_layout(prefix, grid)
    row_tile = torch.tensor([tile for tile, _ in tiles])
    n_tiles, n_video = len(sizes), len(sizes) - p
    keep = max(1, min(math.ceil((1 - sparsity) * n_video), n_video))
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            means = [torch.stack([x[b, row_tile == j, h].mean(0) for j in range(n_tiles)]) for x in (q, k, v)]
            scores = means[0] @ means[1].T / math.sqrt(q.shape[-1])
            compressed = torch.softmax(scores, -1) @ means[2]
            for i in range(n_tiles):
                keys = set(range(n_tiles))
                if i >= p:
                    video = sorted(range(p, n_tiles), key=lambda j, i=i: -scores[i, j].item())[:keep]
                    keys = set(range(p)) | set(video)
                allowed = torch.tensor([int(row_tile[r]) in keys for r in range(q.shape[1])])
                rows = row_tile == i
                logits = q[b, rows, h] @ k[b, allowed, h].T / math.sqrt(q.shape[-1])
                out[b, rows, h] = torch.softmax(logits, -1) @ v[b, allowed, h]
                if gate is not None:
                    out[b, rows, h] += gate[b, rows, h].double() * compressed[i]
    return out


@pytest.mark.parametrize("prefix, grid", SHAPES[:3])
@pytest.mark.parametrize("with_gate", [False, True])
def test_reference_matches_row_by_row_computation(prefix, grid, with_gate):
    geometry, q, k, v, gate = _inputs(prefix, grid, 2, 16, torch.float32, seed=3, gate=with_gate)
    got = vsa_ref.vsa_h3_attention(q, k, v, geometry, 0.6, gate)
    expected = _brute_force(q.cpu(), k.cpu(), v.cpu(), None if gate is None else gate.cpu(), prefix, grid, 0.6)
    assert _err(got.cpu(), expected) < 1e-5
    assert _err(attention(q, k, v).cpu(), expected) > 1e-2  # sparse is not dense here


def test_reference_in_bf16_stays_close_to_fp32():
    geometry, q, k, v, gate = _inputs((5, 0, 70), (5, 6, 9), 3, 32, torch.bfloat16, seed=4)
    got = vsa_ref.vsa_h3_attention(q, k, v, geometry, 0.6, gate)
    expected = vsa_ref.vsa_h3_attention(q.float(), k.float(), v.float(), geometry, 0.6, gate.float())
    assert got.dtype == torch.bfloat16 and _err(got, expected) < 1e-2


# -- Triton kernel -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "prefix, grid, dim, sparsity, with_gate",
    [
        ((5, 0, 70), (5, 6, 9), 16, 0.6, True),
        ((130,), (3, 5, 4), 32, 0.5, False),
        ((0, 17, 64), (4, 8, 8), 64, 0.7, True),
        ((), (6, 3, 5), 16, 0.8, True),
        ((64, 1), (2, 4, 9), 128, 0.75, True),
    ],
)
def test_triton_matches_reference(prefix, grid, dim, sparsity, with_gate, dtype):
    geometry, q, k, v, gate = _inputs(prefix, grid, 3, dim, dtype, seed=dim, gate=with_gate)
    got = vsa_h3_attention(q, k, v, geometry, sparsity, gate, backend="triton")
    assert got.dtype == dtype and got.shape == q.shape
    upcast = [t.float() for t in (q, k, v)]
    expected = vsa_ref.vsa_h3_attention(*upcast, geometry, sparsity, None if gate is None else gate.float())
    assert _err(got, expected) <= {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert _err(attention(q, k, v).float(), expected) > 1e-2


@pytest.mark.parametrize("with_gate", [False, True])
def test_prefix_rows_through_the_kernel_match_the_dense_dispatch(with_gate):
    from h3gen.kernels.vsa_h3 import triton as vsa_triton

    geometry, q, k, v, gate = _inputs((5, 0, 70), (3, 4, 9), 2, 16, torch.float32, seed=9, gate=with_gate)
    config = vsa_triton.KernelConfig(prefix_in_kernel=True)
    got = vsa_h3_attention(q, k, v, geometry, 0.6, gate, backend="triton", config=config)
    expected = vsa_h3_attention(q, k, v, geometry, 0.6, gate, backend="triton")
    assert _err(got, expected) < 1e-5
    assert _err(got[:, :75], expected[:, :75]) < 1e-5


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_kernel_settings_agree_on_views_of_one_buffer(num_stages, tma):
    """Every pipeline depth, key tiles through pointers and through TMA, on q/k/v that are strided views of one
    (B, S, 3, H, D) buffer."""
    from h3gen.kernels.vsa_h3 import triton as vsa_triton

    geometry = build_tile_geometry((5, 0, 70), (5, 6, 9)).to(DEVICE)
    qkv = _rand(2, geometry.num_rows, 3, 2, 32, dtype=torch.float32, generator=_case(11))
    q, k, v = qkv.unbind(2)
    gate = _rand(2, geometry.num_rows, 2, 32, dtype=torch.float32, generator=_case(12))
    config = vsa_triton.KernelConfig(num_warps=4, num_stages=num_stages, tma=tma)
    got = vsa_h3_attention(q, k, v, geometry, 0.7, gate, backend="triton", config=config)
    expected = vsa_ref.vsa_h3_attention(q.contiguous(), k.contiguous(), v.contiguous(), geometry, 0.7, gate)
    assert _err(got, expected) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "prefix, grid, dim, with_gate",
    [((5, 0, 70), (5, 6, 9), 16, True), ((130,), (3, 5, 4), 64, False), ((0, 17, 64), (4, 8, 8), 32, True)],
)
def test_tma_and_pointer_reads_give_the_same_rows(prefix, grid, dim, with_gate, dtype):
    """The kernel reading key tiles through TMA descriptors writes what it writes reading them through pointers, bit
    for bit (the same tiles in the same order into the same arithmetic), partial tiles and the gate included."""
    from h3gen.kernels.vsa_h3 import triton as vsa_triton

    geometry, q, k, v, gate = _inputs(prefix, grid, 2, dim, dtype, seed=dim + 3, gate=with_gate)
    got = {
        tma: vsa_h3_attention(
            q, k, v, geometry, 0.6, gate, backend="triton", config=vsa_triton.KernelConfig(4, 2, tma=tma)
        )
        for tma in (False, True)
    }
    assert torch.equal(got[True], got[False])


def test_a_setting_beyond_shared_memory_falls_back_to_one_that_fits(monkeypatch):
    import triton

    from h3gen.kernels.vsa_h3 import triton as vsa_triton

    launched, real_launch = [], vsa_triton._launch

    def launch(*args, fits=lambda config: config.num_stages == 1):
        launched.append(args[-1])
        if not fits(args[-1]):
            raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
        return real_launch(*args)

    monkeypatch.setattr(vsa_triton, "_launch", launch)
    monkeypatch.setattr(vsa_triton, "_LAUNCHED", {})
    geometry, q, k, v, gate = _inputs((5, 0, 70), (5, 6, 9), 2, 16, torch.float32, seed=14)
    got = vsa_h3_attention(q, k, v, geometry, 0.7, gate, backend="triton")
    first = vsa_triton.default_config(q.device, 16)
    assert launched[0] == first and launched[-1].num_stages == 1 and all(c.num_stages > 1 for c in launched[:-1])
    assert _err(got, vsa_ref.vsa_h3_attention(q, k, v, geometry, 0.7, gate)) < 1e-5
    launched.clear()
    vsa_h3_attention(q, k, v, geometry, 0.7, gate, backend="triton")
    assert [c.num_stages for c in launched] == [1]  # the setting that fitted is kept

    monkeypatch.setattr(vsa_triton, "_LAUNCHED", {})
    monkeypatch.setattr(vsa_triton, "_launch", lambda *args: launch(*args, fits=lambda config: False))
    with pytest.raises(ValueError, match="shared memory.*H3GEN_VSA_BACKEND=reference"):
        vsa_h3_attention(q, k, v, geometry, 0.7, gate, backend="triton")


# -- the FP8 kernel (the fast tier's) ----------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_tiles_are_the_heads_quantized_then_tiled(transposed):
    """`tile_rows` with descales writes the e4m3 values `quantize_heads` makes, in tile order (transposed: each
    tile's channels along its slots), padding zero; its means are those of the unquantized rows."""
    from h3gen.kernels.fp8_quant import FP8, head_descales
    from h3gen.kernels.fp8_quant import reference as quant_ref
    from h3gen.kernels.vsa_h3 import triton_tiles

    geometry, x, *_ = _inputs((5, 0, 70), (5, 6, 9), 3, 32, DTYPES[-1], seed=21, gate=False)
    descale = head_descales(x)
    slots, means = triton_tiles.tile_rows(x, geometry, descale=descale, transposed=transposed)
    values, expected_descale = quant_ref.quantize_heads(x)
    assert torch.allclose(descale, expected_descale, rtol=1e-6, atol=0)
    assert slots.dtype == FP8 and slots.shape == (2, geometry.num_slots, 3, 32)
    assert (slots.stride(1) == 1) == transposed and (slots.stride(3) == 1) != transposed
    assert_same_fp8(slots, geometry.tile(values.float()).to(FP8))
    assert torch.equal(means, triton_tiles.tile_rows(x, geometry, copy=False)[1])


@pytest.mark.parametrize(
    "prefix, grid, dim, sparsity, with_gate",
    [((5, 0, 70), (5, 6, 9), 32, 0.6, True), ((130,), (3, 5, 4), 32, 0.5, False), ((64, 1), (2, 4, 9), 64, 0.75, True)],
)
def test_fp8_kernel_matches_the_fp8_reference(prefix, grid, dim, sparsity, with_gate):
    """The FP8 kernel's video rows against the reference over e4m3-rounded q/k/v (the kernel also rounds its
    probabilities: 1.2-2.3 % measured), and further from the unrounded reference (2.9-5.5 %); TMA and pointer reads
    alike, bit for bit; its prefix rows are the dense attention's in the heads' dtype, as without FP8."""
    from h3gen.kernels.vsa_h3 import triton as vsa_triton

    geometry, q, k, v, gate = _inputs(prefix, grid, 2, dim, DTYPES[-1], seed=len(prefix) + dim, batch=1, gate=with_gate)
    got = {
        tma: vsa_h3_attention(
            q, k, v, geometry, sparsity, gate, backend="triton", config=vsa_triton.KernelConfig(4, 2, tma=tma), fp8=True
        )
        for tma in (False, True)
    }
    assert torch.equal(got[True], got[False]) and got[True].dtype == q.dtype
    upcast = [t.float() for t in (q, k, v)]
    gate32 = None if gate is None else gate.float()
    rounded = vsa_ref.vsa_h3_attention(*upcast, geometry, sparsity, gate32, fp8=True)
    exact = vsa_ref.vsa_h3_attention(*upcast, geometry, sparsity, gate32)
    video = slice(geometry.prefix_rows, None)
    near = _err(got[True][:, video], rounded[:, video])
    assert near < 0.035 and _err(got[True][:, video], exact[:, video]) > 1.5 * near
    plain = vsa_h3_attention(q, k, v, geometry, sparsity, gate, backend="triton")
    assert torch.equal(got[True][:, : geometry.prefix_rows], plain[:, : geometry.prefix_rows])


def test_fp8_follows_the_dense_backend_and_refuses_what_it_cannot_take():
    """fp8=None: FP8 exactly when the dense attention is FP8 (the fast tier's "fa3-fp8"); the kernel takes e4m3
    slots only with their descales and transposed values, and leaves prefix rows to the dense attention; heads of
    16 channels (below an FP8 MMA's 32) stay in their dtype."""
    from h3gen.kernels.vsa_h3 import triton as vsa_triton
    from h3gen.kernels.vsa_h3 import triton_tiles

    geometry, q, k, v, gate = _inputs((5, 0, 70), (3, 4, 9), 2, 32, torch.float32, seed=22)
    small = [t[..., :16].contiguous() for t in (q, k, v, gate)]
    for backend in ("reference", "triton"):
        plain = vsa_h3_attention(*small[:3], geometry, 0.6, small[3], backend=backend)
        assert torch.equal(vsa_h3_attention(*small[:3], geometry, 0.6, small[3], backend=backend, fp8=True), plain)
    fp8 = vsa_h3_attention(q, k, v, geometry, 0.6, gate, backend="reference", fp8=True)
    assert torch.equal(
        vsa_h3_attention(q, k, v, geometry, 0.6, gate, backend="reference", dense_backend="fa3-fp8"), fp8
    )
    assert not torch.equal(vsa_h3_attention(q, k, v, geometry, 0.6, gate, backend="reference"), fp8)

    descales = torch.ones(3, 2, 2, device=DEVICE)
    keys = triton_tiles.tile_rows(k, geometry, descale=descales[1])[0]
    values = triton_tiles.tile_rows(v, geometry, descale=descales[2], transposed=True)[0]
    selection = select_tiles(tile_scores(*(tile_means(geometry.tile(t), geometry) for t in (q, k))), geometry, 0.6)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="descales"):
        vsa_triton.block_sparse_attention(q, keys, values, selection, geometry, out)
    with pytest.raises(ValueError, match="transposed"):
        vsa_triton.block_sparse_attention(q, keys, keys, selection, geometry, out, descales=descales)
    with pytest.raises(ValueError, match="descales"):
        vsa_triton.block_sparse_attention(
            q, geometry.tile(k), geometry.tile(v), selection, geometry, out, descales=descales
        )
    with pytest.raises(ValueError, match="prefix_in_kernel"):
        config = vsa_triton.KernelConfig(prefix_in_kernel=True)
        vsa_h3_attention(q, k, v, geometry, 0.6, backend="triton", config=config, fp8=True)


@pytest.mark.parametrize("prefix, grid", SHAPES)
def test_tile_kernels_match_the_torch_tiling_means_and_selection(prefix, grid):
    from h3gen.kernels.vsa_h3 import triton_tiles

    geometry, x, y, *_ = _inputs(prefix, grid, 3, 16, torch.float32, seed=13, gate=False)
    slots, means = triton_tiles.tile_rows(x, geometry)
    assert torch.equal(slots, geometry.tile(x))
    assert torch.allclose(means, tile_means(geometry.tile(x), geometry), rtol=1e-6, atol=1e-6)
    assert triton_tiles.tile_rows(x, geometry, copy=False)[0] is None
    scores = tile_scores(means, triton_tiles.tile_rows(y, geometry, copy=False)[1])
    for sparsity in (0.0, 0.5, 0.85):
        got, expected = triton_tiles.select_tiles(scores, geometry, sparsity), select_tiles(scores, geometry, sparsity)
        assert torch.equal(got.q2k_idx, expected.q2k_idx) and torch.equal(got.q2k_num, expected.q2k_num)
        assert (got.first_q_tile, got.num_tiles) == (expected.first_q_tile, expected.num_tiles)


def test_selection_kernel_breaks_ties_toward_the_lower_tile():
    from h3gen.kernels.vsa_h3 import triton_tiles

    geometry = build_tile_geometry((70,), (5, 6, 9)).to(DEVICE)
    p, v, t = geometry.num_prefix_tiles, geometry.num_video_tiles, geometry.num_tiles
    scores = torch.zeros(1, 2, t, t, device=DEVICE)
    scores[0, 1, :, p + 5] = 1.0  # head 1: one tile above a tie of the rest
    selection = triton_tiles.select_tiles(scores, geometry, 0.7)
    keep = kept_video_tiles(0.7, v)
    prefix = list(range(p))
    assert selection.q2k_idx[0, 0, 0].tolist() == prefix + list(range(p, p + keep))
    assert selection.q2k_idx[0, 1, 0].tolist() == prefix + sorted({p + 5, *range(p, p + keep - 1)})
    assert (selection.q2k_num == p + keep).all()


# -- dense cases and errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
@pytest.mark.parametrize("sparsity", [0.0, 0.05])  # 0.05 of 12 video tiles keeps all 12
def test_all_tiles_kept_is_dense_attention_exactly(backend, sparsity):
    geometry, q, k, v, gate = _inputs((5, 70), (5, 6, 9), 2, 16, DTYPES[-1], seed=5)
    assert kept_video_tiles(sparsity, geometry.num_video_tiles) == geometry.num_video_tiles
    dense = attention(q, k, v)
    assert torch.equal(vsa_h3_attention(q, k, v, geometry, sparsity, backend=backend), dense)
    assert torch.equal(vsa_h3_attention(q, k, v, geometry, sparsity, torch.zeros_like(gate), backend=backend), dense)
    gated = vsa_h3_attention(q, k, v, geometry, sparsity, gate, backend=backend)
    expected = _brute_force(q.cpu(), k.cpu(), v.cpu(), gate.cpu(), (5, 70), (5, 6, 9), sparsity)
    assert _err(gated.cpu(), expected) < 5e-3 and not torch.equal(gated, dense)


def test_sequence_without_video_is_dense_attention_exactly():
    geometry, q, k, v, _ = _inputs((30, 100), None, 2, 16, torch.float32, seed=6)
    assert torch.equal(vsa_h3_attention(q, k, v, geometry, 0.9), attention(q, k, v))


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, True, "0.5", float("nan")])
def test_sparsity_outside_0_1_is_refused(sparsity):
    geometry, q, k, v, _ = _inputs((5,), (2, 2, 2), 1, 16, torch.float32, seed=7, gate=False)
    with pytest.raises(ValueError, match="sparsity"):
        vsa_h3_attention(q, k, v, geometry, sparsity)


def test_mismatched_inputs_are_refused():
    geometry, q, k, v, gate = _inputs((5,), (2, 2, 2), 1, 16, torch.float32, seed=8)
    with pytest.raises(ValueError, match="13 rows"):
        vsa_h3_attention(q[:, :12], k[:, :12], v[:, :12], geometry, 0.5)
    with pytest.raises(ValueError, match="gate"):
        vsa_h3_attention(q, k, v, geometry, 0.5, gate[..., :8])
    with pytest.raises(ValueError, match="backend"):
        vsa_h3_attention(q, k, v, geometry, 0.5, backend="flex")


def test_backend_choice_and_override(monkeypatch):
    geometry, q, k, v, _ = _inputs((5, 70), (5, 6, 9), 2, 24, torch.float32, seed=10, gate=False)
    with pytest.raises(ValueError, match="takes fp32/fp16/bf16 heads"):
        resolve_backend(q, "triton")  # 24 channels: not a kernel head size
    monkeypatch.setenv("H3GEN_TRITON", "1")
    assert resolve_backend(q) == "reference"  # auto falls back for a head size the kernel does not take
    assert resolve_backend(q[..., :16]) == "triton"
    monkeypatch.setenv("H3GEN_VSA_BACKEND", "reference")
    q, k, v = (t[..., :16].contiguous() for t in (q, k, v))
    assert resolve_backend(q, "triton") == "reference"
    expected = vsa_ref.vsa_h3_attention(q, k, v, geometry, 0.6)
    assert torch.equal(vsa_h3_attention(q, k, v, geometry, 0.6, backend="triton"), expected)


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_benchmark_runs_tiny():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sparse.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dense/sparse" in result.stdout


def test_the_benchmarks_kernel_halves_do_what_they_say():
    """`benchmarks/sparse_floors.py` (the kernel's reads alone, its math alone): the reads reach every listed key and
    value tile (the exclusive-or of their bits), the math is attention over each query tile's first listed tile
    (softmax over copies of one tile is softmax over the tile)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sparse_floors

    from h3gen.kernels.vsa_h3 import triton as vsa_triton
    from h3gen.kernels.vsa_h3 import triton_tiles

    geometry = build_tile_geometry((5, 0, 30), (3, 5, 9)).to(DEVICE)
    g = _case(7)
    q, k, v = (_rand(1, geometry.num_rows, 2, 32, dtype=torch.float16, generator=g) for _ in range(3))
    k_slots, k_means = triton_tiles.tile_rows(k, geometry)
    v_slots, _ = triton_tiles.tile_rows(v, geometry)
    selection = triton_tiles.select_tiles(
        tile_scores(triton_tiles.tile_rows(q, geometry, copy=False)[1], k_means), geometry, 0.5
    )
    config = vsa_triton.KernelConfig(4, 2)
    sink = sparse_floors.reads_only(k_slots, v_slots, selection, config)
    assert torch.equal(
        sparse_floors.reads_only(k_slots, v_slots, selection, vsa_triton.KernelConfig(4, 2, tma=True)), sink
    )
    out = sparse_floors.math_only(q, k_slots, v_slots, selection, geometry, torch.zeros_like(q), config)
    key_tiles, value_tiles = (x[0].view(-1, 64, 2, 32) for x in (k_slots, v_slots))
    sizes, rows = geometry.tile_sizes.long().cpu(), geometry.slot_rows.long().cpu()
    num_q_tiles = selection.q2k_idx.shape[2]
    for head in range(2):
        for t in range(num_q_tiles):
            listed = selection.q2k_idx[0, head, t, : selection.q2k_num[0, head, t]].long()
            bits = torch.zeros(64, 32, dtype=torch.int16, device=sink.device)
            for x in (key_tiles[listed, :, head], value_tiles[listed, :, head]):
                for tile_bits in x.view(torch.int16):
                    bits ^= tile_bits
            assert sink[head * num_q_tiles + t] == bits.max().float()
            first = int(listed[0])
            tile = selection.first_q_tile + t
            query_rows = rows[tile * 64 : tile * 64 + int(sizes[tile])]
            keys = key_tiles[first, : sizes[first], head].float()
            scores = q[0, query_rows, head].float() @ keys.T / math.sqrt(32)
            expected = scores.softmax(-1) @ value_tiles[first, : sizes[first], head].float()
            assert _err(out[0, query_rows, head], expected) < 2e-3
