"""The tile geometry of VSA-H3: which 64-slot tile every row of a packed sequence falls into.

The packed sequence is `[text | conditions | audio | video]`, the target video last, its rows in row-major
(t, h, w) order of the post-patch grid. Each prefix segment (text, conditions, audio, in that order; empty ones
dropped) is cut into 64-row chunks plus one remainder chunk, none crossing a segment boundary; the video is cut into
(4, 4, 4) boxes of the grid, ceil-divided on each axis so edge boxes are partial, enumerated t-major, then h, then w,
with the rows inside a box in row-major order (FastVideo `video_sparse_attn_h3.py` `_h3_tile_geometry`). Every
tile owns 64 slots; a tile's valid rows take its first slots and the rest are padding.

All of it depends only on the request's shape: build it once per request, move it to the device once, and hand the
same object to every layer and forward.
"""

import math
from dataclasses import dataclass, fields

import torch

TILE_ROWS = 64
VIDEO_TILE = (4, 4, 4)


@dataclass(frozen=True)
class TileGeometry:
    """Rows <-> tile slots of one packed sequence.

    Attributes:
        num_rows: S, the packed sequence length.
        num_tiles: T = num_prefix_tiles + num_video_tiles; prefix tiles come first.
        num_prefix_tiles: P, the chunks of the text, condition and audio segments.
        num_video_tiles: the (4, 4, 4) tiles of the target video (0 for a sequence without video).
        prefix_rows: rows before the video (the sum of the prefix segments).
        tile_sizes: `(T,)` int32, the valid rows of each tile (1..64).
        gather_index: `(T * 64,)` int64, slot -> row; padding slots hold `num_rows` (one past the last row).
        slot_rows: `(T * 64,)` int32, slot -> row with -1 at padding slots (what the Triton kernels read).
        untile_index: `(S,)` int64, row -> slot.
        pad_slots: `(T * 64 - S,)` int64, the padding slots.
        row_tile: `(S,)` int64, row -> tile (`untile_index // 64`).
    """

    num_rows: int
    num_tiles: int
    num_prefix_tiles: int
    num_video_tiles: int
    prefix_rows: int
    tile_sizes: torch.Tensor
    gather_index: torch.Tensor
    slot_rows: torch.Tensor
    untile_index: torch.Tensor
    pad_slots: torch.Tensor
    row_tile: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.num_tiles * TILE_ROWS

    @property
    def device(self) -> torch.device:
        return self.tile_sizes.device

    def to(self, device: torch.device | str) -> "TileGeometry":
        """The same geometry with its index tensors on `device`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TileGeometry(**{name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in values.items()})

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, S, H, D)` rows -> `(B, T * 64, H, D)` tile slots of the same dtype, padding slots zero."""
        if x.shape[1] != self.num_rows:
            raise ValueError(f"the geometry has {self.num_rows} rows, the tensor {x.shape[1]} (dim 1).")
        out = x.new_empty(x.shape[0], self.num_slots, *x.shape[2:])
        out.index_copy_(1, self.untile_index, x)
        return out.index_fill_(1, self.pad_slots, 0)

    def untile(self, slots: torch.Tensor) -> torch.Tensor:
        """`(B, T * 64, H, D)` tile slots -> `(B, S, H, D)` rows (padding slots dropped)."""
        return slots.index_select(1, self.untile_index)


def build_tile_geometry(
    prefix_lengths: tuple[int, ...] | list[int],
    video_grid: tuple[int, int, int] | None,
    num_rows: int | None = None,
) -> TileGeometry:
    """The tile geometry of `[prefix segments | video]`, on the CPU (move it with `.to(device)`).

    Args:
        prefix_lengths: rows of the text, condition and audio segments in packed order (zeros allowed, dropped).
        video_grid: the target video's post-patch grid (t, h, w), or None for a sequence without video (then every
            tile is a prefix tile and nothing is sparse).
        num_rows: the packed sequence length, checked against the segments when given.
    Raises:
        ValueError: a negative segment or grid size, or segments that do not add up to `num_rows`.
    """
    prefix_lengths = [int(n) for n in prefix_lengths]
    grid = (0, 0, 0) if video_grid is None else tuple(int(n) for n in video_grid)
    if len(grid) != 3 or any(n < 0 for n in prefix_lengths) or any(n < 0 for n in grid):
        raise ValueError(
            "prefix segment lengths must be non-negative and the video grid three non-negative sizes (t, h, w), got "
            f"{prefix_lengths} and {video_grid}."
        )
    prefix_rows = sum(prefix_lengths)
    video_rows = math.prod(grid)
    total = prefix_rows + video_rows
    if num_rows is not None and total != num_rows:
        raise ValueError(
            f"the packed sequence has {num_rows} rows, but its segments add up to {total} (prefix "
            f"{prefix_lengths} = {prefix_rows} rows, video grid {grid} = {video_rows} rows)."
        )

    row_slot_parts, sizes_parts = [], []
    tiles = 0
    for length in prefix_lengths:
        if length == 0:
            continue
        offset = torch.arange(length)
        row_slot_parts.append(tiles * TILE_ROWS + offset)  # chunk c of the segment is tile `tiles + c`
        chunks = -(-length // TILE_ROWS)
        sizes = torch.full((chunks,), TILE_ROWS)
        sizes[-1] = length - (chunks - 1) * TILE_ROWS
        sizes_parts.append(sizes)
        tiles += chunks
    num_prefix_tiles = tiles

    num_video_tiles = 0
    if video_rows:
        (t, h, w), (bt, bh, bw) = grid, VIDEO_TILE
        nt, nh, nw = -(-t // bt), -(-h // bh), -(-w // bw)
        num_video_tiles = nt * nh * nw
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        tt, hh, ww = tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)
        # Extent of each row's tile along h and w (partial at the far edges): the strides of the row-major flatten
        # inside that tile.
        ext_h = (h - hh // bh * bh).clamp(max=bh)
        ext_w = (w - ww // bw * bw).clamp(max=bw)
        tile = (tt // bt * nh + hh // bh) * nw + ww // bw
        inside = ((tt % bt) * ext_h + hh % bh) * ext_w + ww % bw
        row_slot_parts.append((tiles + tile) * TILE_ROWS + inside)
        ext = [(n - torch.arange(-(-n // b)) * b).clamp(max=b) for n, b in zip(grid, VIDEO_TILE, strict=True)]
        sizes_parts.append((ext[0][:, None, None] * ext[1][None, :, None] * ext[2][None, None, :]).reshape(-1))
        tiles += num_video_tiles

    untile_index = torch.cat(row_slot_parts) if row_slot_parts else torch.zeros(0, dtype=torch.long)
    tile_sizes = torch.cat(sizes_parts).to(torch.int32) if sizes_parts else torch.zeros(0, dtype=torch.int32)
    gather_index = torch.full((tiles * TILE_ROWS,), total, dtype=torch.long)
    gather_index[untile_index] = torch.arange(total)
    pad_slots = (gather_index == total).nonzero().reshape(-1)
    geometry = TileGeometry(
        num_rows=total,
        num_tiles=tiles,
        num_prefix_tiles=num_prefix_tiles,
        num_video_tiles=num_video_tiles,
        prefix_rows=prefix_rows,
        tile_sizes=tile_sizes,
        gather_index=gather_index,
        slot_rows=torch.where(gather_index == total, -1, gather_index).to(torch.int32),
        untile_index=untile_index,
        pad_slots=pad_slots,
        row_tile=untile_index // TILE_ROWS,
    )
    _check(geometry)
    return geometry


def _check(geometry: TileGeometry) -> None:
    """Every row lands in a distinct slot below its tile's valid count (FastVideo checks its geometry the same way,
    once per shape)."""
    slot_in_tile = geometry.untile_index % TILE_ROWS
    sizes = geometry.tile_sizes.long()
    if (
        geometry.untile_index.numel()
        and (
            int(geometry.untile_index.max()) >= geometry.num_slots
            or bool((slot_in_tile >= sizes[geometry.row_tile]).any())
        )
    ) or int(sizes.sum()) != geometry.num_rows:
        raise ValueError("tile geometry is inconsistent: a row falls outside its tile's valid slots.")
