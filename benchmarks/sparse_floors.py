"""Two halves of the VSA-H3 block-sparse kernel (`kernels/vsa_h3/triton.py`), each timed alone, to show which one
bounds it: its reads (every program walks its listed key tiles and loads keys and values, with no math) and its math
(every program runs its loop of dots and online softmax as often, on one key tile loaded once). The kernel can run no
faster than the slower of the two; where it runs at the speed of the reads, only fewer bytes make it faster.

Same launch grid, launch settings, key-tile lists and tiled key/value layout as the kernel.
"""

import math

import torch
import triton
import triton.language as tl

from h3gen.kernels.vsa_h3.geometry import TILE_ROWS
from h3gen.kernels.vsa_h3.triton import tile_descriptors

_LOG2E = 1.4426950408889634


@triton.jit
def _reads_only(
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    sink_ptr,
    idx_ptr,
    num_ptr,
    heads,
    num_q_tiles,
    max_kv,
    stride_kb,
    stride_ks,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TMA: tl.constexpr,
):
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    desc_row = (bh // heads) * (stride_kb // stride_ks)
    desc_col = (bh % heads) * HEAD_DIM
    kv_head = b * stride_kb + h * stride_kh
    tile_stride = BLOCK * stride_ks.to(tl.int64)
    offsets = slots[:, None] * stride_ks + dims[None, :]
    row = bh.to(tl.int64) * num_q_tiles + q_tile
    count = tl.load(num_ptr + row)
    kv_list = idx_ptr + row * max_kv
    # A running exclusive-or of the bits keeps every load live at integer instructions (no conversions).
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.int16)
    for j in tl.range(0, count, num_stages=NUM_STAGES):
        kv_tile = tl.load(kv_list + j)
        if TMA:
            k = k_desc.load([desc_row + kv_tile * BLOCK, desc_col])
            v = v_desc.load([desc_row + kv_tile * BLOCK, desc_col])
        else:
            k = tl.load(k_ptr + kv_head + kv_tile * tile_stride + offsets)
            v = tl.load(v_ptr + kv_head + kv_tile * tile_stride + offsets)
        acc = acc ^ k.to(tl.int16, bitcast=True) ^ v.to(tl.int16, bitcast=True)
    tl.store(sink_ptr + row, tl.max(tl.max(acc, 1), 0).to(tl.float32))


@triton.jit
def _math_only(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    idx_ptr,
    num_ptr,
    sizes_ptr,
    rows_ptr,
    heads,
    first_q_tile,
    num_q_tiles,
    max_kv,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = tl.load(rows_ptr + (first_q_tile + q_tile) * BLOCK + slots)
    q_valid = q_rows >= 0
    q_offsets = tl.where(q_valid, q_rows, 0).to(tl.int64)
    q_base = b * stride_qb + h * stride_qh
    q = tl.load(q_ptr + q_base + q_offsets[:, None] * stride_qs + dims[None, :])
    row = bh.to(tl.int64) * num_q_tiles + q_tile
    count = tl.load(num_ptr + row)
    # The program's first listed key tile, loaded once and used on every step.
    kv_tile = tl.load(idx_ptr + row * max_kv)
    kv_base = b * stride_kb + h * stride_kh + kv_tile * BLOCK * stride_ks.to(tl.int64)
    k = tl.load(k_ptr + kv_base + slots[None, :] * stride_ks + dims[:, None])
    v = tl.load(v_ptr + kv_base + slots[:, None] * stride_ks + dims[None, :])
    size = tl.load(sizes_ptr + kv_tile)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # q @ k is the same on every step: fed an accumulator of the last step's scores times zero (not folded away for
    # floats), it stays in the loop instead of being hoisted out of it, at one multiply per score.
    zeros = tl.zeros([BLOCK, BLOCK], tl.float32)
    for _ in tl.range(0, count, num_stages=NUM_STAGES):
        s = tl.dot(q, k, zeros)
        zeros = s * 0.0
        s = tl.where(slots[None, :] < size, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_base + q_offsets[:, None] * stride_qs + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_valid[:, None],
    )


def reads_only(key_slots, value_slots, selection, config) -> torch.Tensor:
    """The kernel's key/value reads alone over `selection`'s lists (through TMA when `config.tma`): `(B * H * V,)`
    float32, one value per program.

    key_slots, value_slots: `(B, T * 64, H, D)` bf16/fp16 tiled keys and values of one layout."""
    idx, num = selection.q2k_idx.contiguous(), selection.q2k_num.contiguous()
    b, _, h, d = key_slots.shape
    num_q_tiles, max_kv = idx.shape[2], idx.shape[3]
    sink = torch.empty(b * h * num_q_tiles, device=key_slots.device, dtype=torch.float32)
    descs = (key_slots, value_slots)  # unused without TMA
    if config.tma:  # as the kernel reads them
        descs = tile_descriptors(key_slots, value_slots)
    _reads_only[(num_q_tiles, b * h)](
        key_slots,
        value_slots,
        *descs,
        sink,
        idx,
        num,
        h,
        num_q_tiles,
        max_kv,
        *key_slots.stride()[:3],
        HEAD_DIM=d,
        BLOCK=TILE_ROWS,
        NUM_STAGES=config.num_stages,
        TMA=config.tma,
        num_warps=config.num_warps,
    )
    return sink


def math_only(query, key_slots, value_slots, selection, geometry, out, config) -> torch.Tensor:
    """The kernel's math alone: each query tile of `selection` runs as many steps as it lists key tiles, all on its
    first listed tile. query, out: `(B, S, H, D)` bf16/fp16 packed rows (out of query's strides)."""
    idx, num = selection.q2k_idx.contiguous(), selection.q2k_num.contiguous()
    b, _, h, d = query.shape
    num_q_tiles, max_kv = idx.shape[2], idx.shape[3]
    _math_only[(num_q_tiles, b * h)](
        query,
        key_slots,
        value_slots,
        out,
        idx,
        num,
        geometry.tile_sizes,
        geometry.slot_rows,
        h,
        selection.first_q_tile,
        num_q_tiles,
        max_kv,
        *query.stride()[:3],
        *key_slots.stride()[:3],
        _LOG2E / math.sqrt(d),
        HEAD_DIM=d,
        BLOCK=TILE_ROWS,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return out
