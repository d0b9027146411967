"""How the Triton MXFP4 GEMM kernels cut a product: programs over (row tiles, output tiles, K slices) and where a
program writes its tile (`program_tile`, `store_tile`), K cut into slices of whole tiles that add into a float32
output (`k_slices`), and how many slices keep enough packed weight bytes in flight for a few rows (`auto_split`).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def program_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and outputs (with their in-range masks) and its K slice [k_start, k_stop), for the grid
    (row tiles, output tiles, K slices) the GEMM kernels share."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_om, TRANSPOSED: tl.constexpr, ATOMIC: tl.constexpr):
    """Write a program's float32 `acc` (`(rows, outputs)`, or `(outputs, rows)` when `TRANSPOSED`) to the `[M, N]`
    output: added atomically when K slices share it, else cast to the output's dtype."""
    if TRANSPOSED:
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
    else:
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Packed weight bytes a small-M product should have requested at any moment to keep HBM busy (bandwidth x latency
# on the H200 is about 4 MB). Each program reads one (block_n, block_k / 2) byte tile per step, so all programs
# together have about N * block_k / 2 bytes in flight; splitting K multiplies that.
IN_FLIGHT_BYTES = 6 << 20


def auto_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """K slices for a small-M product: enough for `IN_FLIGHT_BYTES` in flight, each slice at least 2 K tiles."""
    wanted = triton.cdiv(IN_FLIGHT_BYTES, n * block_k // 2)
    return max(1, min(8, wanted, k // (2 * block_k)))


def k_slices(x, n: int, split_k: int, block_k: int) -> tuple[int, int, torch.Tensor]:
    """K cut into about `split_k` slices of whole tiles: (elements per slice, slices, output). With several slices
    the output is float32 zeros they add into atomically (the caller casts it back), else the result itself."""
    m, k = x.shape
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    slices = triton.cdiv(k, k_per_split)
    out = (
        torch.zeros((m, n), dtype=torch.float32, device=x.device)
        if slices > 1
        else torch.empty((m, n), dtype=x.dtype, device=x.device)
    )
    return k_per_split, slices, out
