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

The FP8 variant (`descales` given) quantizes its query rows with their head's descale, reads e4m3 key tiles and e4m3
value tiles stored transposed (each tile's channels along its slots: Hopper's FP8 tensor-core MMA takes its second
operand with the reduced dimension contiguous only), scales the scores by both descales and rounds p to e4m3 for
p @ v; the values' descale is applied once, in the epilogue.

The launch settings (`KernelConfig`) are exposed for a GPU benchmark to sweep; `default_config` picks one per device.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from h3gen.kernels.fp8_quant import FP8
from h3gen.kernels.fp8_quant.triton import interpreted, to_e4m3
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
    descale_ptr,
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
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
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
    FP8: tl.constexpr,
    E4M3_BY_HAND: tl.constexpr,
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
    if FP8:  # q quantized here with its head's descale; scores come out of the dots scaled by both descales
        q_descale = tl.load(descale_ptr + bh)
        qk_scale = qk_scale * q_descale * tl.load(descale_ptr + tl.num_programs(1) + bh)
        q = to_e4m3(tl.clamp(q.to(tl.float32) / q_descale, -448.0, 448.0), E4M3_BY_HAND)

    # 64-bit scalar bases per tile, 32-bit offsets inside a tile. Through TMA a key tile is rows
    # (b * slots + tile * 64 ..) and columns (h * D ..) of the copy seen as (B * slots, H * D); a value tile the same
    # or, transposed (FP8), rows ((b * H + h) * D ..) and columns (tile * 64 ..) of the copy seen as (B * H * D, slots).
    k_head = b * stride_kb + h * stride_kh
    v_head = b * stride_vb + h * stride_vh
    desc_row = (bh // heads) * (stride_kb // stride_ks)
    desc_col = (bh % heads) * HEAD_DIM
    k_offsets = slots[None, :] * stride_ks + dims[:, None]  # (dim, slot): k read transposed for q @ k
    v_offsets = slots[:, None] * stride_vs + dims[None, :] * stride_vd  # (slot, dim)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    row = bh.to(tl.int64) * num_q_tiles + q_tile
    count = tl.load(num_ptr + row)
    kv_list = idx_ptr + row * max_kv
    for j in tl.range(0, count, num_stages=NUM_STAGES):
        kv_tile = tl.load(kv_list + j)
        if TMA:
            k = tl.trans(k_desc.load([desc_row + kv_tile * BLOCK, desc_col]))
        else:
            k = tl.load(k_ptr + k_head + kv_tile.to(tl.int64) * (BLOCK * stride_ks) + k_offsets)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = tl.where(slots[None, :] < tl.load(sizes_ptr + kv_tile), s, float("-inf"))
        # Scaled after the max (the scale is positive): one multiply-add per score for the exponent.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA and FP8:
            v = tl.trans(v_desc.load([bh * HEAD_DIM, kv_tile * BLOCK]))
        elif TMA:
            v = v_desc.load([desc_row + kv_tile * BLOCK, desc_col])
        else:
            v = tl.load(v_ptr + v_head + kv_tile.to(tl.int64) * (BLOCK * stride_vs) + v_offsets)
        p = to_e4m3(p, E4M3_BY_HAND) if FP8 else p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        out = acc * (tl.load(descale_ptr + 2 * tl.num_programs(1) + bh) / l_i[:, None])
    else:
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
    descales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the selected query tiles over their selected key tiles, written into their rows of `out`.

    Args:
        query: `(B, S, H, D)` packed rows (fp32, fp16 or bf16, contiguous heads, D in `HEAD_DIMS`, any other strides).
        key_slots, value_slots: `(B, T * 64, H, D)` padding slots zero (`triton_tiles.tile_rows` or `geometry.tile`):
            in query's dtype, one layout with contiguous heads; or, the FP8 kernel, e4m3 keys with contiguous heads
            and e4m3 values transposed (`tile_rows(..., transposed=True)`).
        selection: the key tiles of query tiles `first_q_tile ..` (`selection.select_tiles`).
        out: `(B, S, H, D)` the output rows; the rows of the selected query tiles are written, the others are left
            as they are.
        gate: `(B, S, H, D)` or None; with it, `compressed` `(B, H, T, D)` float32 and each written row gets
            `gate[row] * compressed[tile(row)]` added.
        config: launch settings; when None the device's default, or the first smaller setting that fits its shared
            memory.
        descales: with e4m3 slots, `(3, B, H)` float32: the per-head descales of query (quantized in the kernel),
            keys and values (`fp8_quant.head_descales`).
    Returns:
        `out`.
    """
    for name, x in (("query", query), ("out", out)) + ((("gate", gate),) if gate is not None else ()):
        check_heads(x, geometry, f"block_sparse_attention's {name}")
        if x.shape != query.shape:
            raise ValueError(f"block_sparse_attention's {name} {tuple(x.shape)} is not query's {tuple(query.shape)}.")
    b, _, h, d = query.shape
    _check_slots(key_slots, value_slots, (b, geometry.num_slots, h, d), query.dtype, descales)
    idx, num = selection.q2k_idx.contiguous(), selection.q2k_num.contiguous()
    if idx.shape[2] == 0:
        return out
    if gate is not None:
        compressed = compressed.contiguous()
    if descales is not None:
        descales = descales.float().contiguous()
    args = (query, key_slots, value_slots, out, gate, compressed, descales, idx, num, geometry, selection.first_q_tile)
    if config is not None:
        _launch(*args, config)
        return out
    chosen = (query.device, query.dtype, key_slots.dtype, d)
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


def _check_slots(key_slots, value_slots, shape, dtype, descales) -> None:
    """ValueError unless the slots are what `block_sparse_attention` takes (see there)."""
    fp8 = key_slots.dtype == FP8
    if fp8:
        layouts_ok = key_slots.stride(3) == 1 and value_slots.stride(1) == 1 and value_slots.dtype == FP8
        wanted = "e4m3 keys with contiguous heads and e4m3 values transposed (tile_rows(..., transposed=True))"
    else:
        layouts_ok = (
            key_slots.dtype == value_slots.dtype == dtype
            and key_slots.stride(3) == 1
            and value_slots.stride() == key_slots.stride()
        )
        wanted = f"{dtype} with contiguous heads, one layout"
    if not layouts_ok or key_slots.shape != shape or value_slots.shape != shape:
        raise ValueError(
            f"block_sparse_attention takes key and value slots of shape {shape}, {wanted}; got "
            f"{tuple(key_slots.shape)} {key_slots.dtype} with strides {key_slots.stride()} and "
            f"{tuple(value_slots.shape)} {value_slots.dtype} with strides {value_slots.stride()}."
        )
    if fp8 != (descales is not None) or (fp8 and descales.shape != (3, shape[0], shape[2])):
        raise ValueError(
            f"block_sparse_attention takes (3, B, H) = (3, {shape[0]}, {shape[2]}) descales with e4m3 slots and none "
            f"otherwise, got {None if descales is None else tuple(descales.shape)} with {key_slots.dtype} slots."
        )


def tile_descriptors(*slots: torch.Tensor) -> list[TensorDescriptor]:
    """TMA descriptors over contiguous tiled copies `(B, T * 64, H, D)` (`triton_tiles.tile_rows`), one `(64, D)`
    box per tile: a copy with contiguous heads seen as `(B * T * 64, H * D)`, the tile of batch b, head h, tile t the
    box at rows `(b * T + t) * 64`, columns `h * D`; a transposed copy (memory `(B, H, D, T * 64)`) seen as
    `(B * H * D, T * 64)` with a `(D, 64)` box, the tile at rows `(b * H + h) * D`, columns `t * 64`."""
    descriptors = []
    for x in slots:
        b, num_slots, h, d = x.shape
        if _transposed(x):
            descriptors.append(
                TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1).view(b * h * d, num_slots), [d, TILE_ROWS])
            )
        else:
            descriptors.append(TensorDescriptor.from_tensor(x.view(b * num_slots, h * d), [TILE_ROWS, d]))
    return descriptors


def _transposed(slots: torch.Tensor) -> bool:
    return slots.stride(1) == 1 and slots.shape[1] > 1


def _tma_ready(slots: torch.Tensor) -> bool:
    """Whether TMA can read these slots: a contiguous copy (or a transposed one) whose base is 16-byte aligned."""
    memory = slots.permute(0, 2, 3, 1) if _transposed(slots) else slots
    return memory.is_contiguous() and slots.data_ptr() % 16 == 0


def _launch(query, key_slots, value_slots, out, gate, compressed, descales, idx, num, geometry, first_q_tile, config):
    """One launch of `_block_sparse_fwd` over the query tiles `idx` lists (see `block_sparse_attention`)."""
    b, _, h, d = query.shape
    num_q_tiles, max_kv = idx.shape[2], idx.shape[3]
    gated = gate is not None
    fp8 = descales is not None
    tma = config.tma and _tma_ready(key_slots) and _tma_ready(value_slots)
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
        descales if fp8 else out,
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
        *value_slots.stride(),
        *out.stride()[:3],
        *(gate.stride()[:3] if gated else (0, 0, 0)),
        _LOG2E / math.sqrt(d),
        HEAD_DIM=d,
        BLOCK=TILE_ROWS,
        GATED=gated,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 and not fp8 else "tf32",
        NUM_STAGES=config.num_stages,
        TMA=tma,
        FP8=fp8,
        E4M3_BY_HAND=interpreted(),
        num_warps=config.num_warps,
    )
