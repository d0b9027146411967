"""MXFP4 weights times 1-16 rows of bf16 activations on the tensor cores, in Gluon: `few_rows_matmul(x, packed,
scales)`, the host side of `gluon_kernels`: which products it takes (`supports`), whether the weights come through
the TMA ring (`uses_ring`) and the scales fold into the decode (`foldable`), the tile and K slices (`plan`: about six
K steps per program, more slices while the grid is small), and the float32 workspace the K slices add into.

Hopper (and Ampere) GPUs, bf16 activations, K a multiple of 128; other cases take the Triton paths
(`kernels.mxfp4_gemm.triton`)."""

import functools
import os

import torch
import triton

from h3gen.kernels._arrivals import arrival_counters
from h3gen.kernels.mxfp4_gemm import gluon_kernels

BLOCK_K = 128  # K elements per step: 64 bytes of each weight row
TARGET_STEPS = 6  # K steps per program, balancing the per-program latency against the split-K reduction
MAX_ROWS = 16
# K steps of weights in shared memory on Hopper: deeper rings measured slower on the H200 (5376x7168, one row:
# 12.2 us with 2 slots, 13.6 with 4, 16.3 with 6).
RING_STAGES = 2


_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_SMS: dict[torch.device, int] = {}
_CAPABLE: dict[torch.device, bool] = {}


def _sm_count(device: torch.device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _workspace(device: torch.device, needed: int) -> torch.Tensor:
    """Float32 zeros the K slices add into (kept at zero between launches; one per device, never shrunk, so a
    captured graph keeps using the buffer it was captured with)."""
    buffer = _WORKSPACES.get(device)
    if buffer is None or buffer.numel() < needed:
        buffer = torch.zeros(max(needed, 1 << 18), dtype=torch.float32, device=device)
        _WORKSPACES[device] = buffer
    return buffer


def supports(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `few_rows_matmul` takes this product: Gluon importable, a CUDA GPU of compute capability 8.0 or
    newer, bf16 activations of 1-16 rows, K a multiple of `BLOCK_K`, packed rows 16-byte aligned. `H3GEN_GLUON=0`
    turns this path off (the Triton paths run instead)."""
    if not gluon_kernels.AVAILABLE or not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("H3GEN_GLUON") == "0":
        return False
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] % BLOCK_K:
        return False
    if packed.shape[1] * 2 != x.shape[1] or packed.stride(-1) != 1 or packed.stride(0) % 4 or packed.data_ptr() % 16:
        return False
    if scales.stride(-1) != 1:
        return False
    return _capability(x.device) >= 8


def _capability(device: torch.device) -> int:
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device)[0]
    return _CAPABLE[device]


def uses_ring(packed: torch.Tensor) -> bool:
    """Whether the weights go through the TMA ring (`few_rows_tma_kernel`): Hopper or newer, Triton with Gluon's
    TMA, packed rows a multiple of 16 bytes apart (TMA's stride rule)."""
    return gluon_kernels.HAS_TMA and packed.is_cuda and _capability(packed.device) >= 9 and packed.stride(0) % 16 == 0


_FOLDABLE = torch.utils.weak.WeakIdKeyDictionary()


def foldable(scales: torch.Tensor) -> bool:
    """Whether every E8M0 byte of `scales` is at most 128 or 255 (NaN), so the kernel may multiply the decoded codes
    (E2M1 * 2^-126) by 2^(e-1) in one bf16 multiply and stay exact (2^(e-1) <= 2^127 is a bf16 normal). Weight
    scales above 128 mean blocks larger than 12 in magnitude; the kernel then multiplies twice. The answer is kept
    per tensor until it is written to; during CUDA-graph capture an unchecked tensor counts as not foldable (the
    check needs a synchronizing read)."""
    cached = _FOLDABLE.get(scales)
    if cached is not None and cached[0] == scales._version:
        return cached[1]
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    answer = bool(((scales <= 128) | (scales == 255)).all())
    _FOLDABLE[scales] = (scales._version, answer)
    return answer


@functools.lru_cache(maxsize=1024)
def plan(m: int, n: int, k: int, sms: int, ring: bool = False) -> tuple[int, int, int]:
    """(rows of W per program, warps, K slices) for an `[m, k] x [k, n]` product: through the TMA ring (`ring`) 64
    rows on 2 warps; otherwise 128 rows on 4 warps up to 8 activation rows, 64 on 2 beyond (the accumulator
    doubles); K slices dividing K's steps, about `TARGET_STEPS` steps each, more while fewer than two programs per
    SM (swept on the H200: slices of about 6 steps beat 3 or 12; through the ring, 64 rows on 2 warps beat 256 on
    4)."""
    block_n, warps = (128, 4) if m <= 8 and not ring else (64, 2)
    steps = k // BLOCK_K
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    splits = min(divisors, key=lambda d: (abs(steps / d - TARGET_STEPS), -d))
    while block_n > 32 and triton.cdiv(n, block_n) * steps < 2 * sms:  # small weights: narrower tiles
        block_n, warps = block_n // 2, 2
    tiles = triton.cdiv(n, block_n)
    for d in divisors:
        if d > splits and tiles * splits < 2 * sms:
            splits = d
    return block_n, warps, splits


def few_rows_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_n: int | None = None,
    warps: int | None = None,
    splits: int | None = None,
    ring: bool | None = None,
    fold: bool | None = None,
) -> torch.Tensor:
    """`x` `[M, K]` bf16 (M <= 16) times the dequantized weight (`packed` `[N, K/2]` uint8, `scales` `[N, K/32]`
    uint8) transposed -> `[M, N]` bf16, float32 accumulation. `block_n`, `warps`, `splits` override `plan`;
    `ring` (weights through the TMA ring, default `uses_ring`) and `fold` (scales folded into the decode, default
    `foldable`) override the automatic choices; `fold=True` on scales that do not fold is refused."""
    if not supports(x, packed, scales):
        raise ValueError(
            "the Gluon few-row path takes 1-16 rows of bf16 activations on a CUDA GPU (compute "
            f"capability 8.0+) with K a multiple of {BLOCK_K}; got {tuple(x.shape)} {x.dtype} on "
            f"{x.device}."
        )
    if ring and not uses_ring(packed):
        raise ValueError(
            "the TMA ring needs a Hopper GPU, Triton with Gluon's TMA and packed rows a multiple of 16 bytes apart."
        )
    ring = uses_ring(packed) if ring is None else ring
    if fold and not foldable(scales):
        raise ValueError("these scales do not fold (an E8M0 byte above 128 other than 255).")
    fold = foldable(scales) if fold is None else fold
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    planned = plan(m, n, k, _sm_count(x.device), ring)
    block_n = block_n or planned[0]
    warps = warps or planned[1]
    splits = splits or planned[2]
    if (k // BLOCK_K) % splits:
        raise ValueError(f"{splits} K slices do not divide the {k // BLOCK_K} steps of K = {k}.")
    tiles = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    workspace = _workspace(x.device, m * n)
    counts = arrival_counters(x.device, "mxfp4_few_rows", tiles)
    shape = dict(BN=block_n, BK=BLOCK_K, MN=8 if m <= 8 else 16, WARPS=warps, FOLD=fold, num_warps=warps)
    if ring:
        words = _words_descriptor(packed, block_n)
        gluon_kernels.few_rows_tma_kernel[(tiles, splits)](
            words,
            scales,
            x.view(torch.int32),
            workspace,
            counts,
            out,
            n,
            m,
            k // splits,
            splits,
            scales.stride(0),
            x.stride(0) // 2,
            STAGES=RING_STAGES,
            **shape,
        )
    else:
        gluon_kernels.few_rows_kernel[(tiles, splits)](
            packed.view(torch.int32),
            scales,
            x.view(torch.int32),
            workspace,
            counts,
            out,
            n,
            m,
            k // splits,
            splits,
            packed.stride(0) // 4,
            scales.stride(0),
            x.stride(0) // 2,
            **shape,
        )
    return out


_DESCRIPTORS = torch.utils.weak.WeakIdKeyDictionary()


def _words_descriptor(packed: torch.Tensor, block_n: int):
    """The TMA descriptor of `packed` `[N, K/2]` uint8 as int32 words `[N, K/8]` in `[block_n, BLOCK_K / 8]` boxes,
    kept per tensor (building one costs several microseconds of host time per call). The descriptor's int32 tensor
    shares `packed`'s storage without being a view of it, so the cache entry does not keep `packed` alive."""
    per_tensor = _DESCRIPTORS.setdefault(packed, {})
    key = (packed.data_ptr(), block_n)
    if key not in per_tensor:
        per_tensor.clear()
        words = torch.empty(0, dtype=torch.int32, device=packed.device).set_(
            packed.untyped_storage(),
            packed.storage_offset() // 4,
            (packed.shape[0], packed.shape[1] // 4),
            (packed.stride(0) // 4, 1),
        )
        per_tensor[key] = gluon_kernels.ring_descriptor(words, block_n, BLOCK_K // 8)
    return per_tensor[key]
