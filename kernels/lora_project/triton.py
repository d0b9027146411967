"""`x A^T` for a thin `A` (`rank` rows, 128-384): one program per `BLOCK_M` rows and `BLOCK_N` columns, the whole K
loop pipelined through TMA loads, so that every SM streams its rows of `x` once."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _project(x_desc, a_desc, out_desc, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             STAGES: tl.constexpr):
    row, col = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(x_desc.load([row, k]), a_desc.load([col, k]).T, acc)
    out_desc.store([row, col], acc.to(out_desc.dtype))


def project(x: torch.Tensor, down: torch.Tensor, out: torch.Tensor, block_m: int = 64, block_n: int = 128,
            block_k: int = 64, stages: int = 6, num_warps: int = 4) -> torch.Tensor:
    """`out` `(M, R)` = `x` `(M, K)` @ `down` `(R, K)`^T, bf16 or fp16, float32 accumulation; `x` and `out` may be
    column slices of wider buffers (16-byte aligned rows)."""
    M, K = x.shape
    R = down.shape[0]
    descs = [TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(down, [block_n, block_k]),
             TensorDescriptor.from_tensor(out, [block_m, block_n])]
    grid = (triton.cdiv(M, block_m), triton.cdiv(R, block_n))
    _project[grid](*descs, K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
    return out
