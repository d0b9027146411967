"""The tile side of VSA-H3 in Triton: tile means of packed rows (read in place through `TileGeometry.slot_rows`),
the tiled copy of keys and values the block-sparse kernel reads made in the same pass, and the top-k selection.

`tile_rows`: one program per (batch x head, tile): the tile's valid rows loaded once, their fp32 sum over the valid
count stored as the tile's mean and, when asked, the 64 slots written (padding slots zero), so keys and values are
read once for both; for the FP8 kernel the slots are written in e4m3 (divided by the head's descale), values with
each tile's channels along its slots. `select_tiles`: a few (batch x head, video query tile) rows per program: each
row's video key tile scores mapped to int32 in the same order, the k-th largest found by bisection over the int32
range (32 counting passes, no sort), and the tiles above it (then the first tiles equal to it, up to k) written in
ascending order after the prefix tiles: what `selection.select_tiles` returns, without its top-k, sort and concat.
"""

import torch
import triton
import triton.language as tl

from h3gen.kernels.fp8_quant import FP8
from h3gen.kernels.fp8_quant.triton import interpreted, to_e4m3
from h3gen.kernels.vsa_h3.geometry import TILE_ROWS, TileGeometry
from h3gen.kernels.vsa_h3.selection import TileSelection, kept_video_tiles

HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _tile_rows(
    x_ptr,
    slots_ptr,
    means_ptr,
    rows_ptr,
    sizes_ptr,
    descale_ptr,
    heads,
    num_tiles,
    stride_b,
    stride_s,
    stride_h,
    slot_stride_b,
    slot_stride_s,
    slot_stride_h,
    slot_stride_d,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_SLOTS: tl.constexpr,
    FP8: tl.constexpr,
    E4M3_BY_HAND: tl.constexpr,
):
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.load(rows_ptr + tile * BLOCK + slots)
    valid = rows >= 0
    offsets = tl.where(valid, rows, 0).to(tl.int64)
    x = tl.load(
        x_ptr + b * stride_b + h * stride_h + offsets[:, None] * stride_s + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    if WRITE_SLOTS:
        slot = (tile * BLOCK + slots).to(tl.int64)
        to = slots_ptr + b * slot_stride_b + h * slot_stride_h + slot[:, None] * slot_stride_s
        if FP8:
            descale = tl.load(descale_ptr + bh)
            scaled = tl.clamp(x.to(tl.float32) / descale, -448.0, 448.0)
            tl.store(to + dims[None, :] * slot_stride_d, to_e4m3(scaled, E4M3_BY_HAND))
        else:
            tl.store(to + dims[None, :] * slot_stride_d, x)
    sums = tl.sum(x.to(tl.float32), 0)
    size = tl.load(sizes_ptr + tile).to(tl.float32)
    tl.store(means_ptr + (bh.to(tl.int64) * num_tiles + tile) * HEAD_DIM + dims, sums / size)


def check_heads(x: torch.Tensor, geometry: TileGeometry, what: str) -> None:
    """ValueError unless `x` is `(B, S, H, D)` over the geometry's rows with contiguous heads of D in `HEAD_DIMS`."""
    if x.ndim != 4 or x.shape[1] != geometry.num_rows or x.shape[-1] not in HEAD_DIMS or x.stride(3) != 1:
        raise ValueError(
            f"{what} takes (B, {geometry.num_rows}, H, D) rows with contiguous heads of D in {HEAD_DIMS}, got "
            f"{tuple(x.shape)} with strides {x.stride()}."
        )


def tile_rows(
    x: torch.Tensor,
    geometry: TileGeometry,
    copy: bool = True,
    *,
    descale: torch.Tensor | None = None,
    transposed: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Tile means of packed rows and, with `copy`, their tiled copy, in one read of `x`.

    Args:
        x: `(B, S, H, D)` fp32/fp16/bf16 rows, contiguous heads, D in `HEAD_DIMS`.
        copy: also return the rows as tile slots.
        descale: `(B, H)` float32 per-head descales (`fp8_quant.head_descales`): the slots are e4m3, each value
            `x / descale` saturated to +-448.
        transposed: the slots' memory is `(B, H, D, T * 64)` (a permuted view): each tile's channels run along its
            slots, the layout of the FP8 kernel's values (Hopper's FP8 tensor-core MMA takes its second operand with
            the reduced dimension contiguous only).
    Returns:
        `(slots, means)`: slots `(B, T * 64, H, D)` in x's dtype (e4m3 with `descale`), padding slots zero
        (`geometry.tile(x)`), or None without `copy`; means `(B, H, T, D)` float32, each tile's fp32 sum over its
        valid rows (before any quantization) divided by their count (`selection.tile_means`).
    """
    check_heads(x, geometry, "tile_rows")
    b, _, h, d = x.shape
    means = torch.empty(b, h, geometry.num_tiles, d, dtype=torch.float32, device=x.device)
    dtype = x.dtype if descale is None else FP8
    slots = None
    if copy and transposed:
        slots = torch.empty(b, h, d, geometry.num_slots, dtype=dtype, device=x.device).permute(0, 3, 1, 2)
    elif copy:
        slots = torch.empty(b, geometry.num_slots, h, d, dtype=dtype, device=x.device)
    if descale is not None and descale.shape != (b, h):
        raise ValueError(f"tile_rows takes (B, H) = {(b, h)} descales, got {tuple(descale.shape)}.")
    if geometry.num_tiles:
        _tile_rows[(b * h, geometry.num_tiles)](
            x,
            means if slots is None else slots,
            means,
            geometry.slot_rows,
            geometry.tile_sizes,
            means if descale is None else descale.float().contiguous(),
            h,
            geometry.num_tiles,
            *x.stride()[:3],
            *(slots.stride() if copy else (0, 0, 0, 0)),
            HEAD_DIM=d,
            BLOCK=TILE_ROWS,
            WRITE_SLOTS=copy,
            FP8=descale is not None,
            E4M3_BY_HAND=interpreted(),
        )
    return slots, means


@triton.jit
def _select_tiles(
    scores_ptr,
    idx_ptr,
    num_ptr,
    num_prefix,
    num_video,
    num_tiles,
    num_rows,
    keep,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (batch x head) x num_video + query tile
    row_live = rows < num_rows
    bh = rows // num_video
    q_tile = num_prefix + rows % num_video
    cols = tl.arange(0, BLOCK_V)
    live = row_live[:, None] & (cols[None, :] < num_video)
    first = (bh * num_tiles + q_tile) * num_tiles + num_prefix
    scores = tl.load(scores_ptr + first[:, None] + cols[None, :], mask=live, other=0.0)
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as int32 order
    ordered = tl.where(live, ordered, -(2**31))  # below every score, -inf included
    # The k-th largest `ordered` of each row: the largest t with at least k values >= t, by bisection over int32.
    low = tl.full([ROWS], -(2**31), tl.int64)
    high = tl.full([ROWS], 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = (low + high + 1) >> 1
        enough = tl.sum((ordered.to(tl.int64) >= mid[:, None]).to(tl.int32), 1) >= keep
        low = tl.where(enough, mid, low)
        high = tl.where(enough, high, mid - 1)
    threshold = low[:, None]
    above = ordered.to(tl.int64) > threshold
    at = live & (ordered.to(tl.int64) == threshold)
    room = keep - tl.sum(above.to(tl.int32), 1)
    chosen = above | (at & (tl.cumsum(at.to(tl.int32), 1) <= room[:, None]))
    place = tl.cumsum(chosen.to(tl.int32), 1) - 1
    width = num_prefix + keep
    out = idx_ptr + rows[:, None] * width
    prefix = tl.arange(0, BLOCK_P)
    tl.store(out + prefix[None, :], prefix[None, :], mask=row_live[:, None] & (prefix[None, :] < num_prefix))
    tl.store(out + num_prefix + place, num_prefix + cols[None, :], mask=chosen)
    tl.store(num_ptr + rows, width, mask=row_live)


def select_tiles(scores: torch.Tensor, geometry: TileGeometry, sparsity: float) -> TileSelection:
    """`selection.select_tiles` in one kernel: the same tiles in the same order (ties, which random scores do not
    have, go to the lower tile index here and unspecified in torch's top-k).

    Args:
        scores: `(B, H, T, T)` float32 from `selection.tile_scores`.
        sparsity: the fraction of video tiles dropped, in [0, 1).
    """
    p, v, t = geometry.num_prefix_tiles, geometry.num_video_tiles, geometry.num_tiles
    b, h = scores.shape[:2]
    keep = kept_video_tiles(sparsity, v)
    idx = torch.empty(b, h, v, p + keep, dtype=torch.int32, device=scores.device)
    num = torch.empty(b, h, v, dtype=torch.int32, device=scores.device)
    if v:
        block_v = triton.next_power_of_2(v)
        rows_per_program = max(1, 4096 // block_v)
        _select_tiles[(triton.cdiv(b * h * v, rows_per_program),)](
            scores.contiguous(),
            idx,
            num,
            p,
            v,
            t,
            b * h * v,
            keep,
            ROWS=rows_per_program,
            BLOCK_V=block_v,
            BLOCK_P=triton.next_power_of_2(max(p, 1)),
        )
    return TileSelection(idx, num, p, t)
