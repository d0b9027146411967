"""VSA-H3 attention in plain torch: the selected tiles expanded to a token mask for SDPA, plus the gated compression
branch on every row (FastVideo `video_sparse_attn_h3.py`; SGLang and xDiT add the branch the same way)."""

import torch
import torch.nn.functional as F

from h3gen.kernels.fp8_quant.reference import quantize_heads
from h3gen.kernels.vsa_h3.geometry import TileGeometry
from h3gen.kernels.vsa_h3.selection import compress, select_tiles, selection_map, tile_means, tile_scores


def add_compressed(
    out: torch.Tensor, gate: torch.Tensor, compressed: torch.Tensor, row_tile: torch.Tensor
) -> torch.Tensor:
    """`out + gate * compressed[tile(row)]` in float32, rounded once to `out.dtype`.

    Args:
        out, gate: `(B, R, H, D)` for R rows.
        compressed: `(B, H, T, D)` float32 from `selection.compress`.
        row_tile: `(R,)` int64, the tile of each of the R rows.
    """
    per_row = compressed.index_select(2, row_tile).permute(0, 2, 1, 3)
    return (out.float() + gate.float() * per_row).to(out.dtype)


def vsa_h3_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    geometry: TileGeometry,
    sparsity: float,
    gate: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """VSA-H3 attention of one packed sequence.

    Args:
        query, key, value: `(B, S, H, D)` post-RoPE heads, one float dtype.
        geometry: the sequence's `TileGeometry` (on the same device).
        sparsity: the fraction of video key tiles each video query tile drops, in [0, 1).
        gate: `(B, S, H, D)` the compression gate (`to_gate_compress` of the block's input), or None to skip the
            branch.
        fp8: the video query rows attend over q, k and v rounded to e4m3 per head (`fp8_quant.quantize_heads`,
            dequantized); tile scores, selection, the compression branch and the (dense) prefix rows use the heads
            as given. What the FP8 kernel computes, but for its probabilities, which it also rounds to e4m3.
    Returns:
        `(B, S, H, D)` in query's dtype.
    """
    q_slots, k_slots = geometry.tile(query), geometry.tile(key)
    scores = tile_scores(tile_means(q_slots, geometry), tile_means(k_slots, geometry))
    tile_map = selection_map(select_tiles(scores, geometry, sparsity))
    token_mask = tile_map[:, :, geometry.row_tile][:, :, :, geometry.row_tile]  # (B, H, S, S)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask).transpose(1, 2)
    if fp8:
        q8, k8, v8 = (_rounded_to_fp8(t).transpose(1, 2) for t in (query, key, value))
        rounded = F.scaled_dot_product_attention(q8, k8, v8, attn_mask=token_mask).transpose(1, 2)
        prefix = geometry.prefix_rows
        out = torch.cat([out[:, :prefix], rounded[:, prefix:]], dim=1)
    if gate is None:
        return out
    compressed = compress(scores, tile_means(geometry.tile(value), geometry))
    return add_compressed(out, gate, compressed, geometry.row_tile)


def _rounded_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to e4m3 per head and scaled back, in x's dtype."""
    values, descale = quantize_heads(x)
    return (values.float() * descale[:, None, :, None]).to(x.dtype)
