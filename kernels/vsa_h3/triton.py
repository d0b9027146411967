"""Block-sparse flash attention over 64-row tiles (the sparse half of VSA-H3) in Triton.

One program per (query tile, batch x head). It loads its 64 query rows once, in place in the packed `(B, S, H, D)`
rows through the geometry's slot -> row index (`TileGeometry.slot_rows`, -1 at padding slots), then walks the key
tiles its row of `q2k_idx` lists (prefix tiles first, then its video tiles, ascending) with an fp32 online softmax,
masking key slots beyond each tile's valid rows. Keys and values are read from their tiled copy
(`triton_tiles.tile_rows`): a key tile is then one block at a known address, where reading the packed rows through
the index made each step wait on two dependent index loads (2.3x slower on an H100). On Hopper and newer each tile
comes through a tensor-memory-accelerator (TMA) descriptor over the copy, one bulk copy per tile (1.09-1.12x the
kernel's speed with pointer loads on an H100 at the 5 s 768x1344 shape, same output bit for bit); elsewhere through
pointers, a base address plus offsets fixed for the whole loop. It writes its valid rows straight to their rows of
the output, adding `gate * compressed` there when gated (the compression branch folded into the epilogue). Programs
of one head are adjacent in launch order, so the key tiles that head's query tiles share stay in L2. Head sizes are
powers of two from 16 to 128.

The launch settings (`KernelConfig`) are exposed for a GPU benchmark to sweep; `default_config` picks one per device.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from h3gen.kernels.vsa_h3.geometry import TILE_ROWS, TileGeometry
from h3gen.kernels.vsa_h3.selection import TileSelection
from h3gen.kernels.vsa_h3.triton_tiles import HEAD_DIMS, check_heads

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """How the op runs on the GPU: warps per program, software-pipeline depth of the key-tile loop, whether the
    (dense) prefix query tiles run through this kernel over every key tile instead of the dense attention dispatch,
    and whether key and value tiles are read through TMA descriptors (Hopper and newer) or pointers."""

    num_warps: int = 4
    num_stages: int = 3
    prefix_in_kernel: bool = False
    tma: bool = False  # key and value tiles through TMA descriptors (contiguous tiled copies only)


# What a benchmark sweeps. A 64-row query tile fills one Hopper warpgroup at 4 warps; on an H100 at the 5 s 768x1344
# shape 8 warps ran 1.6-2.3x slower, and two key tiles per loop step (a 64 x 128 score block) 1.26x slower.
CONFIGS = tuple(KernelConfig(4, stages, tma=tma) for tma in (False, True) for stages in (2, 3, 4))


def default_config(device: torch.device, head_dim: int = 128) -> KernelConfig:
    """A launch setting for `head_dim` heads on `device`: Hopper and newer read key tiles through TMA and pipeline
    the loop three deep (on an H100 at the 5 s 768x1344 shape, sparsity 0.9, bf16: 13.3-13.6 ms at 3 or 4 stages,
    13.7 at 2, against 14.9 through pointers; `bench_sparse.py op` sweeps `CONFIGS`); older GPUs and the interpreter
    read through pointers, two deep."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return KernelConfig(num_warps=4, num_stages=3, tma=True)
    return KernelConfig(num_warps=4, num_stages=2)


# The settings tried in turn when none is given and the device's default does not launch: a deep pipeline needs
# shared memory a consumer GPU (about 100 KiB per block) or fp32 heads may not have. The first that launches is kept
# per (device, dtype, head size).
_FALLBACKS = (KernelConfig(4, 2, tma=True), KernelConfig(4, 2), KernelConfig(4, 1))
_LAUNCHED: dict[tuple, KernelConfig] = {}


def supports(query: torch.Tensor) -> bool:
    """Whether the kernel takes these heads: fp32/fp16/bf16, head size in `HEAD_DIMS`."""
    return query.dtype in (torch.float32, torch.float16, torch.bfloat16) and query.shape[-1] in HEAD_DIMS


@triton.jit
def _block_sparse_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
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
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_gb,
    stride_gs,
    stride_gh,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TMA: tl.constexpr,
):
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    tile = first_q_tile + q_tile
    slots = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = tl.load(rows_ptr + tile * BLOCK + slots)
    q_valid = q_rows >= 0
    q_offsets = tl.where(q_valid, q_rows, 0).to(tl.int64)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + q_offsets[:, None] * stride_qs + dims[None, :])

    # Key and value slots share one layout: 64-bit scalar bases per tile, 32-bit offsets inside a tile; through TMA,
    # a tile is rows (b * slots + tile * 64 ..) and columns (h * D ..) of the copy seen as (B * slots, H * D).
    kv_head = b * stride_kb + h * stride_kh
    desc_row = (bh // heads) * (stride_kb // stride_ks)
    desc_col = (bh % heads) * HEAD_DIM
    tile_stride = BLOCK * stride_ks.to(tl.int64)
    k_offsets = slots[None, :] * stride_ks + dims[:, None]  # (dim, slot): k read transposed for q @ k
    v_offsets = slots[:, None] * stride_ks + dims[None, :]  # (slot, dim)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    row = bh.to(tl.int64) * num_q_tiles + q_tile
    count = tl.load(num_ptr + row)
    kv_list = idx_ptr + row * max_kv
    for j in tl.range(0, count, num_stages=NUM_STAGES):
        kv_tile = tl.load(kv_list + j)
        kv_base = kv_head + kv_tile * tile_stride
        if TMA:
            k = tl.trans(k_desc.load([desc_row + kv_tile * BLOCK, desc_col]))
        else:
            k = tl.load(k_ptr + kv_base + k_offsets)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = tl.where(slots[None, :] < tl.load(sizes_ptr + kv_tile), s, float("-inf"))
        # Scaled after the max (the scale is positive): one multiply-add per score for the exponent.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_desc.load([desc_row + kv_tile * BLOCK, desc_col])
        else:
            v = tl.load(v_ptr + kv_base + v_offsets)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    if GATED:
        g = tl.load(
            gate_ptr + b * stride_gb + h * stride_gh + q_offsets[:, None] * stride_gs + dims[None, :],
            mask=q_valid[:, None],
            other=0.0,
        )
        c = tl.load(comp_ptr + (bh.to(tl.int64) * num_tiles + tile) * HEAD_DIM + dims)
        out = out + g.to(tl.float32) * c[None, :]
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + q_offsets[:, None] * stride_os + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_valid[:, None],
    )


def block_sparse_attention(
    query: torch.Tensor,
    key_slots: torch.Tensor,
    value_slots: torch.Tensor,
    selection: TileSelection,
    geometry: TileGeometry,
    out: torch.Tensor,
    gate: torch.Tensor | None = None,
    compressed: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of the selected query tiles over their selected key tiles, written into their rows of `out`.

    Args:
        query: `(B, S, H, D)` packed rows (fp32, fp16 or bf16, contiguous heads, D in `HEAD_DIMS`, any other strides).
        key_slots, value_slots: `(B, T * 64, H, D)` of query's dtype, one layout, padding slots zero
            (`triton_tiles.tile_rows` or `geometry.tile`).
        selection: the key tiles of query tiles `first_q_tile ..` (`selection.select_tiles`).
        out: `(B, S, H, D)` the output rows; the rows of the selected query tiles are written, the others are left
            as they are.
        gate: `(B, S, H, D)` or None; with it, `compressed` `(B, H, T, D)` float32 and each written row gets
            `gate[row] * compressed[tile(row)]` added.
        config: launch settings; when None the device's `default_config`, or the first smaller setting that fits
            its shared memory.
    Returns:
        `out`.
    """
    for name, x in (("query", query), ("out", out)) + ((("gate", gate),) if gate is not None else ()):
        check_heads(x, geometry, f"block_sparse_attention's {name}")
        if x.shape != query.shape:
            raise ValueError(f"block_sparse_attention's {name} {tuple(x.shape)} is not query's {tuple(query.shape)}.")
    b, _, h, d = query.shape
    slots_shape = (b, geometry.num_slots, h, d)
    for x in (key_slots, value_slots):
        if x.shape != slots_shape or x.dtype != query.dtype or x.stride() != key_slots.stride() or x.stride(3) != 1:
            raise ValueError(
                f"block_sparse_attention takes key and value slots of one layout, shape {slots_shape} and dtype "
                f"{query.dtype} with contiguous heads, got {tuple(x.shape)} {x.dtype} with strides {x.stride()}."
            )
    idx, num = selection.q2k_idx.contiguous(), selection.q2k_num.contiguous()
    if idx.shape[2] == 0:
        return out
    if gate is not None:
        compressed = compressed.contiguous()
    args = (query, key_slots, value_slots, out, gate, compressed, idx, num, geometry, selection.first_q_tile)
    if config is not None:
        _launch(*args, config)
        return out
    chosen = (query.device, query.dtype, d)
    if chosen in _LAUNCHED:
        _launch(*args, _LAUNCHED[chosen])
        return out
    first = default_config(query.device, d)
    for candidate in (first, *(c for c in _FALLBACKS if c != first)):
        try:
            _launch(*args, candidate)
        except triton.runtime.errors.OutOfResources:
            continue
        _LAUNCHED[chosen] = candidate
        return out
    raise ValueError(
        f"the VSA-H3 kernel does not fit this GPU's shared memory for {query.dtype} heads of {d} channels; run it with "
        "H3GEN_VSA_BACKEND=reference."
    )


def tile_descriptors(*slots: torch.Tensor) -> list[TensorDescriptor]:
    """TMA descriptors over contiguous tiled copies `(B, T * 64, H, D)` (`triton_tiles.tile_rows`), each seen as
    `(B * T * 64, H * D)` with one `(64, D)` box: the tile of batch b, head h, tile t is the box at rows
    `(b * T + t) * 64`, columns `h * D`."""
    descriptors = []
    for x in slots:
        b, num_slots, h, d = x.shape
        descriptors.append(TensorDescriptor.from_tensor(x.view(b * num_slots, h * d), [TILE_ROWS, d]))
    return descriptors


def _launch(query, key_slots, value_slots, out, gate, compressed, idx, num, geometry, first_q_tile, config):
    """One launch of `_block_sparse_fwd` over the query tiles `idx` lists (see `block_sparse_attention`)."""
    b, _, h, d = query.shape
    num_q_tiles, max_kv = idx.shape[2], idx.shape[3]
    gated = gate is not None
    # TMA takes a contiguous copy whose base is 16-byte aligned (any tile_rows copy).
    tma = config.tma and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (key_slots, value_slots))
    if tma:
        k_desc, v_desc = tile_descriptors(key_slots, value_slots)
    else:
        k_desc, v_desc = key_slots, value_slots  # unused
    _block_sparse_fwd[(num_q_tiles, b * h)](
        query,
        key_slots,
        value_slots,
        k_desc,
        v_desc,
        out,
        gate if gated else out,
        compressed if gated else out,
        idx,
        num,
        geometry.tile_sizes,
        geometry.slot_rows,
        h,
        first_q_tile,
        num_q_tiles,
        geometry.num_tiles,
        max_kv,
        *query.stride()[:3],
        *key_slots.stride()[:3],
        *out.stride()[:3],
        *(gate.stride()[:3] if gated else (0, 0, 0)),
        _LOG2E / math.sqrt(d),
        HEAD_DIM=d,
        BLOCK=TILE_ROWS,
        GATED=gated,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        NUM_STAGES=config.num_stages,
        TMA=tma,
        num_warps=config.num_warps,
    )
