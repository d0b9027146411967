"""VSA-H3 attention: the sparse attention of FastH3 (trained with it) and of the base model without training
(FastVideo `attention/backends/video_sparse_attn_h3.py`, which SGLang, vLLM-Omni and xDiT follow).

`vsa_h3_attention(query, key, value, geometry, sparsity, gate=None)` runs one attention call of a DiT block over
a packed `[text | conditions | audio | video]` sequence. `build_tile_geometry` makes the sequence's `TileGeometry`
once per request shape. On CUDA the video query tiles run the Triton block-sparse kernel and the prefix query rows
(dense in VSA-H3) run the dense attention dispatch; elsewhere the torch reference runs. `backend="reference"` or
`H3GEN_VSA_BACKEND=reference` forces the reference (`=triton` the kernel, also on the CPU under
`TRITON_INTERPRET=1`); `H3GEN_TRITON=0` turns the kernel off as for every op.

When every video tile is kept (sparsity 0, k equal to the video tile count, or no video at all) the sparse part is
dense attention and the op calls `attention(query, key, value)` itself, so its output is that call's, bit for bit,
plus the gated branch when a gate is given.

With `fp8` (on by default under the `fast` tier's FP8 attention, "fa3-fp8") the kernel reads e4m3 key and value
tiles with per-head scales and rounds its probabilities to e4m3 for p @ v, as FlashAttention-3's FP8 attention does:
half the bytes per key tile. Tile scores, selection and the compression branch still come from the heads as given.
"""

import os
from typing import TYPE_CHECKING

import torch

from h3gen.kernels._dispatch import triton_available, use_triton
from h3gen.kernels.attention import attention, fa3_available, takes_fp8_inputs
from h3gen.kernels.fp8_quant import head_descales
from h3gen.kernels.vsa_h3 import reference
from h3gen.kernels.vsa_h3.geometry import TILE_ROWS, VIDEO_TILE, TileGeometry, build_tile_geometry
from h3gen.kernels.vsa_h3.plan import SparsePlan, SparseSwitch
from h3gen.kernels.vsa_h3.reference import add_compressed
from h3gen.kernels.vsa_h3.selection import (
    TileSelection,
    check_sparsity,
    compress,
    kept_video_tiles,
    select_tiles,
    selection_map,
    tile_means,
    tile_scores,
)

if TYPE_CHECKING:
    from h3gen.kernels.vsa_h3.triton import KernelConfig

BACKENDS = ("auto", "triton", "reference")
# An FP8 tensor-core MMA reduces 32 channels at a time (Triton refuses a smaller e4m3 dot on NVIDIA GPUs).
FP8_MIN_HEAD_DIM = 32


def resolve_backend(query: torch.Tensor, backend: str | None = None) -> str:
    """The backend that runs these heads, "triton" or "reference": `H3GEN_VSA_BACKEND` when set, else `backend`,
    else "auto" (the kernel where `use_triton` says so and it takes the dtype and head size)."""
    name = os.environ.get("H3GEN_VSA_BACKEND") or backend or "auto"
    if name not in BACKENDS:
        raise ValueError(f"Unknown VSA-H3 backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    if name == "reference" or (name == "auto" and not use_triton(query)):
        return "reference"
    if not triton_available():
        raise ValueError("the VSA-H3 Triton kernel needs triton, which is not installed.")
    from h3gen.kernels.vsa_h3 import triton as fast  # on first use: see _dispatch

    if fast.supports(query):
        return "triton"
    if name == "triton":
        raise ValueError(
            f"the VSA-H3 Triton kernel takes fp32/fp16/bf16 heads of {fast.HEAD_DIMS} channels, got {query.dtype} "
            f"heads of {query.shape[-1]}."
        )
    return "reference"


def vsa_h3_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    geometry: TileGeometry,
    sparsity: float,
    gate: torch.Tensor | None = None,
    backend: str | None = None,
    *,
    dense_backend: str | None = None,
    config: "KernelConfig | None" = None,
    fp8: bool | None = None,
) -> torch.Tensor:
    """VSA-H3 attention of one packed sequence.

    Args:
        query, key, value: `(B, S, H, D)` post-RoPE heads, one float dtype, on the geometry's device.
        geometry: `build_tile_geometry(...)` of this sequence, moved to the device.
        sparsity: the fraction of video key tiles each video query tile drops, in [0, 1); each keeps
            k = max(1, min(ceil((1 - sparsity) * N_video), N_video)) video tiles and every prefix tile.
        gate: `(B, S, H, D)` the compression gate (the block's `to_gate_compress` output, no activation), or None
            to skip the compression branch (the base model).
        backend: "auto" (None), "triton" or "reference" (see the module docstring).
        dense_backend: the `attention` backend for the dense parts (prefix query rows, everything when all video
            tiles are kept).
        config: the Triton launch settings (`triton.KernelConfig`); when None the device's default, or a smaller
            setting where the default does not fit its shared memory.
        fp8: the video query tiles attend over e4m3 queries, keys and values (per-head scales, as FlashAttention-3's
            FP8 attention; the probabilities rounded to e4m3 for p @ v): half the bytes per key tile read. Tile
            scores, selection and the compression branch come from the heads as given, and the prefix rows attend in
            their dtype (through FA3 where `dense_backend` is "fa3-fp8"). None: when `dense_backend` takes FP8
            inputs (the `fast` tier's attention). Heads of fewer than `FP8_MIN_HEAD_DIM` channels run in their
            dtype either way.
    Returns:
        `(B, S, H, D)` in query's dtype.
    """
    if query.ndim != 4 or key.shape != query.shape or value.shape != query.shape:
        raise ValueError(
            f"vsa_h3_attention expects query, key and value of one (B, S, H, D) shape, got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}."
        )
    if gate is not None and gate.shape != query.shape:
        raise ValueError(f"the gate must have the query's shape {tuple(query.shape)}, got {tuple(gate.shape)}.")
    if geometry.num_rows != query.shape[1]:
        raise ValueError(f"the tile geometry has {geometry.num_rows} rows, the sequence {query.shape[1]}.")
    if geometry.device != query.device:
        raise ValueError(
            f"the tile geometry is on {geometry.device}, the heads on {query.device}: move it once with .to()."
        )
    sparsity = check_sparsity(sparsity)
    name = resolve_backend(query, backend)
    if fp8 is None:
        fp8 = takes_fp8_inputs(dense_backend)
    fp8 = fp8 and query.shape[-1] >= FP8_MIN_HEAD_DIM
    if kept_video_tiles(sparsity, geometry.num_video_tiles) == geometry.num_video_tiles:
        out = attention(query, key, value, backend=dense_backend)
        if gate is None:
            return out
        scores = tile_scores(pool_tiles(query, geometry, name), pool_tiles(key, geometry, name))
        compressed = compress(scores, pool_tiles(value, geometry, name))
        return add_compressed(out, gate, compressed, geometry.row_tile)
    if name == "reference":
        return reference.vsa_h3_attention(query, key, value, geometry, sparsity, gate, fp8=fp8)
    if fp8 and config is not None and config.prefix_in_kernel:
        raise ValueError("the FP8 kernel leaves the prefix rows to the dense attention: prefix_in_kernel is not taken.")
    if fp8 and dense_backend == "fa3-fp8":  # the prefix rows in their dtype, as the reference has them
        dense_backend = "fa3" if fa3_available() else "auto"
    return _sparse_triton(query, key, value, geometry, sparsity, gate, dense_backend, config, fp8)


def pool_tiles(x: torch.Tensor, geometry: TileGeometry, backend: str | None = None) -> torch.Tensor:
    """Tile means of packed rows: `(B, S, H, D)` -> `(B, H, T, D)` float32 (`selection.tile_means`), read in place by
    the Triton kernel where `backend` (as in `vsa_h3_attention`) resolves to it, else through `geometry.tile`."""
    if resolve_backend(x, backend) == "triton":
        from h3gen.kernels.vsa_h3 import triton_tiles  # on first use: see _dispatch

        return triton_tiles.tile_rows(x if x.stride(3) == 1 else x.contiguous(), geometry, copy=False)[1]
    return tile_means(geometry.tile(x), geometry)


def _sparse_triton(query, key, value, geometry, sparsity, gate, dense_backend, config, fp8):
    """Tile means, tiled keys and values (e4m3 with `fp8`), and the selection by the tile kernels; the video query
    tiles through the block-sparse kernel, the prefix query rows through `attention` (or the kernel, per `config`)."""
    from h3gen.kernels.vsa_h3 import triton as fast  # on first use: see _dispatch
    from h3gen.kernels.vsa_h3 import triton_tiles

    if any(t.stride(3) != 1 for t in (query, key, value)):
        query, key, value = (t.contiguous() for t in (query, key, value))
    descales = torch.stack([head_descales(t) for t in (query, key, value)]) if fp8 else None
    _, q_means = triton_tiles.tile_rows(query, geometry, copy=False)
    k_slots, k_means = triton_tiles.tile_rows(key, geometry, descale=None if descales is None else descales[1])
    v_slots, v_means = triton_tiles.tile_rows(
        value, geometry, descale=None if descales is None else descales[2], transposed=fp8
    )
    scores = tile_scores(q_means, k_means)
    selection = triton_tiles.select_tiles(scores, geometry, sparsity)
    compressed = None if gate is None else compress(scores, v_means)
    if gate is not None and gate.stride(3) != 1:
        gate = gate.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    prefix = geometry.prefix_rows
    if prefix and config is not None and config.prefix_in_kernel:
        b, _, h, _ = query.shape
        p, t = geometry.num_prefix_tiles, geometry.num_tiles
        every_tile = torch.arange(t, dtype=torch.int32, device=query.device).expand(b, h, p, t)
        dense = TileSelection(every_tile, torch.full((b, h, p), t, dtype=torch.int32, device=query.device), 0, t)
        fast.block_sparse_attention(query, k_slots, v_slots, dense, geometry, out, gate, compressed, config)
    elif prefix:
        dense = attention(query[:, :prefix], key, value, backend=dense_backend)
        if gate is not None:
            dense = add_compressed(dense, gate[:, :prefix], compressed, geometry.row_tile[:prefix])
        out[:, :prefix] = dense
    return fast.block_sparse_attention(
        query, k_slots, v_slots, selection, geometry, out, gate, compressed, config, descales
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor | None,
    plan: SparsePlan | None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of one packed sequence: dense (`attention`) without a plan, else VSA-H3 with this forward's sparsity
    and, for a VSA student, its compression gate.

    Args:
        query, key, value: `(B, S, H, D)` post-RoPE heads.
        gate: `(B, S, H, D)` the block's `to_gate_compress` output, or None (a model without gates).
        plan: this forward's `SparsePlan`, or None.
        backend: the dense attention backend (`kernels.attention`), also for VSA-H3's dense parts.
    Returns:
        `(B, S, H, D)` in query's dtype.
    """
    if plan is None:
        if gate is not None:
            raise ValueError("a VSA student's gated attention needs a tile geometry (a SparsePlan); none was set.")
        return attention(query, key, value, backend=backend)
    return vsa_h3_attention(query, key, value, plan.geometry, plan.sparsity, gate, dense_backend=backend)


__all__ = [
    "BACKENDS",
    "FP8_MIN_HEAD_DIM",
    "SparsePlan",
    "SparseSwitch",
    "attend",
    "TILE_ROWS",
    "VIDEO_TILE",
    "TileGeometry",
    "TileSelection",
    "build_tile_geometry",
    "kept_video_tiles",
    "pool_tiles",
    "resolve_backend",
    "select_tiles",
    "selection_map",
    "tile_means",
    "tile_scores",
    "vsa_h3_attention",
]
