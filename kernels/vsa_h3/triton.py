"""Block-sparse flash attention over 64-row tiles (the sparse half of VSA-H3) in Triton.

One program per (video query tile, batch x head): it loads its 64 query slots once, walks the key tiles its row of
`q2k_idx` lists (prefix tiles first, then its video tiles, ascending) with an fp32 online softmax, masks key slots
at or beyond each key tile's valid rows, and writes its valid rows straight to their packed rows of the output
(through the geometry's slot -> row index, so there is no untile pass). With a gate it adds `gate * compressed`
there too, the compression branch folded into the epilogue. Query and key tiles are both 64 rows (BLOCK_M = BLOCK_N
= 64, FastVideo's tile); head sizes are powers of two from 16 to 128.

Programs of one head are adjacent in launch order, so the key tiles that head's query tiles share stay in L2.
The launch settings (`KernelConfig`) are exposed for a GPU benchmark to sweep; `default_config` picks one per device.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from h3gen.kernels.vsa_h3.geometry import TILE_ROWS, TileGeometry
from h3gen.kernels.vsa_h3.selection import TileSelection

HEAD_DIMS = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """How the op runs on the GPU: warps per program, software-pipeline depth of the key-tile loop, and whether the
    (dense) prefix query tiles run through this kernel over every key tile instead of the dense attention dispatch."""

    num_warps: int = 4
    num_stages: int = 3
    prefix_in_kernel: bool = False


# What a benchmark sweeps (64-row query tiles fill one Hopper warpgroup at 4 warps; 8 warps split the rows further).
CONFIGS = tuple(KernelConfig(w, s) for w in (4, 8) for s in (2, 3, 4))


def default_config(device: torch.device, head_dim: int = 128) -> KernelConfig:
    """A launch setting for `head_dim` heads on `device`: Hopper and newer pipeline four key tiles deep (on an H100 at
    the 5 s 768x1344 shape, sparsity 0.9, bf16: 13.8 ms at 4 warps x 4 stages, 14.2 at 3 stages, 14.6 at 2, 21.5 to
    31.5 at 8 warps); older GPUs and the interpreter two."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return KernelConfig(num_warps=4, num_stages=4)
    return KernelConfig(num_warps=4, num_stages=2)


def supports(query: torch.Tensor) -> bool:
    """Whether the kernel takes these heads: fp32/fp16/bf16, head size in `HEAD_DIMS`."""
    return query.dtype in (torch.float32, torch.float16, torch.bfloat16) and query.shape[-1] in HEAD_DIMS


@triton.jit
def _block_sparse_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    gate_ptr,
    comp_ptr,
    idx_ptr,
    num_ptr,
    sizes_ptr,
    rows_ptr,
    heads,
    first_q_tile,
    num_q_tiles,
    num_tiles,
    max_kv,
    stride_slot_b,
    stride_slot_s,
    stride_slot_h,
    stride_out_b,
    stride_out_s,
    stride_out_h,
    stride_gate_b,
    stride_gate_s,
    stride_gate_h,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    tile = first_q_tile + q_tile
    slots = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    # q, k and v slots share one layout (all three come from `TileGeometry.tile`). 64-bit scalar bases per tile,
    # 32-bit offsets inside a tile: no 64-bit arithmetic per element in the loop.
    head_base = b * stride_slot_b + h * stride_slot_h
    tile_stride = BLOCK * stride_slot_s.to(tl.int64)
    row_major = slots[:, None] * stride_slot_s + dims[None, :]  # (slot, dim): q and v
    col_major = slots[None, :] * stride_slot_s + dims[:, None]  # (dim, slot): k, read transposed for q @ k
    q = tl.load(q_ptr + head_base + tile * tile_stride + row_major)

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    row = bh.to(tl.int64) * num_q_tiles + q_tile
    count = tl.load(num_ptr + row)
    kv_list = idx_ptr + row * max_kv
    for j in tl.range(0, count, num_stages=NUM_STAGES):
        kv_tile = tl.load(kv_list + j)
        kv_valid = tl.load(sizes_ptr + kv_tile)
        kv_base = head_base + kv_tile * tile_stride
        k = tl.load(k_ptr + kv_base + col_major)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(slots[None, :] < kv_valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_base + row_major)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    q_valid = slots < tl.load(sizes_ptr + tile)
    rows = tl.load(rows_ptr + tile * BLOCK + slots, mask=q_valid, other=0)
    if GATED:
        g = tl.load(
            gate_ptr + b * stride_gate_b + h * stride_gate_h + rows[:, None] * stride_gate_s + dims[None, :],
            mask=q_valid[:, None],
            other=0.0,
        )
        c = tl.load(comp_ptr + (bh.to(tl.int64) * num_tiles + tile) * HEAD_DIM + dims)
        out = out + g.to(tl.float32) * c[None, :]
    tl.store(
        out_ptr + b * stride_out_b + h * stride_out_h + rows[:, None] * stride_out_s + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_valid[:, None],
    )


def block_sparse_attention(
    q_slots: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    selection: TileSelection,
    geometry: TileGeometry,
    out: torch.Tensor,
    gate: torch.Tensor | None = None,
    compressed: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of the selected query tiles over their selected key tiles, written into their rows of `out`.

    Args:
        q_slots, k_slots, v_slots: `(B, T * 64, H, D)` from `geometry.tile`, one dtype (fp32, fp16 or bf16), D in
            `HEAD_DIMS`, padding slots zero.
        selection: the key tiles of query tiles `first_q_tile ..` (`selection.select_tiles`).
        out: `(B, S, H, D)` the output rows; the rows of the selected query tiles are written, the others are left
            as they are.
        gate: `(B, S, H, D)` or None; with it, `compressed` `(B, H, T, D)` float32 and each written row gets
            `gate[row] * compressed[tile(row)]` added.
        config: launch settings, `default_config` when None.
    Returns:
        `out`.
    """
    b, slots, h, d = q_slots.shape
    if d not in HEAD_DIMS or slots != geometry.num_slots or not (k_slots.shape == q_slots.shape == v_slots.shape):
        raise ValueError(f"block_sparse_attention takes (B, T * 64, H, D) slots with D in {HEAD_DIMS}.")
    if q_slots.stride() != k_slots.stride() or q_slots.stride() != v_slots.stride() or q_slots.stride(3) != 1:
        raise ValueError("q, k and v slots must share one layout with contiguous heads.")
    if out.stride(3) != 1 or (gate is not None and gate.stride(3) != 1):
        raise ValueError("out and gate must have contiguous heads.")
    config = config or default_config(q_slots.device, d)
    idx, num = selection.q2k_idx.contiguous(), selection.q2k_num.contiguous()
    num_q_tiles, max_kv = idx.shape[2], idx.shape[3]
    if num_q_tiles == 0:
        return out
    gated = gate is not None
    if gated:
        compressed = compressed.contiguous()
    rows = geometry.gather_index
    grid = (num_q_tiles, b * h)
    _block_sparse_fwd[grid](
        q_slots,
        k_slots,
        v_slots,
        out,
        gate if gated else out,
        compressed if gated else out,
        idx,
        num,
        geometry.tile_sizes,
        rows,
        h,
        selection.first_q_tile,
        num_q_tiles,
        geometry.num_tiles,
        max_kv,
        q_slots.stride(0),
        q_slots.stride(1),
        q_slots.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        *(gate.stride()[:3] if gated else (0, 0, 0)),
        _LOG2E / math.sqrt(d),
        HEAD_DIM=d,
        BLOCK=TILE_ROWS,
        GATED=gated,
        DOT_PRECISION="ieee" if q_slots.dtype == torch.float32 else "tf32",
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return out
