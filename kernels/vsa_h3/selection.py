"""VSA-H3 tile scores and selection (FastVideo `_pool_tiles` / `_build_block_mask`, exempt
mode).

Each tile is pooled to its fp32 mean (the sum over its slots divided by its valid rows, so partial tiles are exact
means); tile scores are the pooled queries times the pooled keys over sqrt(D). A video query tile keeps the top k
video key tiles by score, chosen per batch, head and query tile, plus every prefix key tile; prefix query tiles keep
every key tile. Recomputed for every layer and forward; all of it is batched tensor work, no loop over tiles or heads.
"""

import math
from dataclasses import dataclass

import torch

from h3gen.kernels.vsa_h3.geometry import TILE_ROWS, TileGeometry


def check_sparsity(sparsity: float) -> float:
    """`sparsity` as a float in [0, 1), else ValueError."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity is the fraction of video tiles dropped, a number in [0, 1), got {sparsity!r}.")
    return float(sparsity)


def kept_video_tiles(sparsity: float, num_video_tiles: int) -> int:
    """k = max(1, min(ceil((1 - sparsity) * N), N)) video key tiles per query tile (FastVideo `compute_topk`);
    0 when there are no video tiles."""
    if num_video_tiles == 0:
        return 0
    return max(1, min(math.ceil((1.0 - check_sparsity(sparsity)) * num_video_tiles), num_video_tiles))


def tile_means(slots: torch.Tensor, geometry: TileGeometry) -> torch.Tensor:
    """Per-tile means of tiled rows.

    Args:
        slots: `(B, T * 64, H, D)` from `geometry.tile` (padding slots zero), any float dtype.
    Returns:
        `(B, H, T, D)` float32: the fp32 sum over each tile's slots divided by its valid rows.
    """
    b, _, h, d = slots.shape
    sums = slots.view(b, geometry.num_tiles, TILE_ROWS, h, d).sum(2, dtype=torch.float32)
    return (sums / geometry.tile_sizes.to(torch.float32)[None, :, None, None]).permute(0, 2, 1, 3)


def tile_scores(query_means: torch.Tensor, key_means: torch.Tensor) -> torch.Tensor:
    """`(B, H, T, D)` float32 pooled queries and keys -> `(B, H, T, T)` float32 scores q̄·k̄ᵀ / sqrt(D)."""
    return torch.matmul(query_means, key_means.transpose(-1, -2)) / math.sqrt(query_means.shape[-1])


def compress(scores: torch.Tensor, value_means: torch.Tensor) -> torch.Tensor:
    """The compression branch before its gate: softmax over all tiles of `scores` `(B, H, T, T)` times the pooled
    values `(B, H, T, D)`, both float32 -> `(B, H, T, D)` float32 (each tile weighted once, whatever its size)."""
    return torch.matmul(torch.softmax(scores, dim=-1), value_means)


@dataclass(frozen=True)
class TileSelection:
    """The key tiles each sparse (video) query tile reads.

    Attributes:
        q2k_idx: `(B, H, V, P + k)` int32, for video query tile `first_q_tile + i` the key tiles it reads in
            ascending order: every prefix tile, then its k video tiles.
        q2k_num: `(B, H, V)` int32, how many entries of `q2k_idx` each query tile reads (all P + k in exempt mode).
        first_q_tile: P, the first sparse query tile; query tiles before it (the prefix) read every key tile.
        num_tiles: T.
    """

    q2k_idx: torch.Tensor
    q2k_num: torch.Tensor
    first_q_tile: int
    num_tiles: int


def select_tiles(scores: torch.Tensor, geometry: TileGeometry, sparsity: float) -> TileSelection:
    """Exempt-mode selection: top-k video key tiles per (batch, head, video query tile) plus all prefix key tiles.

    Args:
        scores: `(B, H, T, T)` float32 from `tile_scores`.
        sparsity: the fraction of video tiles dropped, in [0, 1).
    """
    p, v = geometry.num_prefix_tiles, geometry.num_video_tiles
    b, h = scores.shape[:2]
    k = kept_video_tiles(sparsity, v)
    top = scores[:, :, p:, p:].topk(k, dim=-1, sorted=False).indices
    video = top.sort(dim=-1).values + p
    prefix = torch.arange(p, device=scores.device).expand(b, h, v, p)
    q2k_idx = torch.cat([prefix, video], dim=-1).to(torch.int32)
    q2k_num = torch.full((b, h, v), p + k, dtype=torch.int32, device=scores.device)
    return TileSelection(q2k_idx, q2k_num, p, geometry.num_tiles)


def selection_map(selection: TileSelection) -> torch.Tensor:
    """The selection as a `(B, H, T, T)` bool tile map (query tile, key tile): prefix query rows all true."""
    b, h, v, width = selection.q2k_idx.shape
    t, p = selection.num_tiles, selection.first_q_tile
    tile_map = torch.zeros(b, h, t, t, dtype=torch.bool, device=selection.q2k_idx.device)
    tile_map[:, :, :p] = True
    used = torch.arange(width, device=tile_map.device) < selection.q2k_num[..., None]
    # Unused entries point at a listed tile of the same row (the first), so scattering them changes nothing.
    idx = torch.where(used, selection.q2k_idx, selection.q2k_idx[..., :1]).long()
    tile_map[:, :, p:].scatter_(-1, idx, True)
    return tile_map
