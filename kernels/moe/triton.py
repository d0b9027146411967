"""`expert_gemv` in Triton: one program per (row, block of N outputs) reads its row's expert matrix straight from the
stacked weights (no gathered copy), so a decode step reads each chosen expert's bytes once per row."""

import torch
import triton
import triton.language as tl

from h3gen.kernels._dispatch import next_power_of_2


@triton.jit
def _expert_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, stride_we, stride_wn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, block_n: int | None = None,
                block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """See `reference.expert_gemv`: `x` `[P, K]`, `weight` `[E, N, K]` (inner axis contiguous), `ids` `[P]`.

    Default tiles: the whole K (up to 2048) in one step and 8 K of weights per program (H200 sweep,
    benchmarks/RESULTS.md: 4 x 2048 for K = 2048, 8 x 1024 for K = 768 were the fastest at 6 to 48 rows)."""
    x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows, k = x.shape
    n = weight.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_k = block_k or min(2048, max(16, next_power_of_2(k)))
    block_n = block_n or max(4, 8192 // block_k)
    _expert_gemv_kernel[(rows, triton.cdiv(n, block_n))](
        x, weight, ids.contiguous(), out, n, k, weight.stride(0), weight.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
