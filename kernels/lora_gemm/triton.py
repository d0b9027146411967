"""`x W^T + h U^T` in one tiled GEMM: the K loop runs over the layer's input and weight, then over the LoRA's
projected input `h = x A^T` and its `U = scale * B`, read from tensors of their own (no `[x | h]` copy)."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _two_source_matmul(x_desc, w_desc, h_desc, u_desc, out_desc, M, N, K, R,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr, HAS_LORA: tl.constexpr, STAGES: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        # Tiles in groups of GROUP_M row tiles, so that programs running together share weight tiles in L2.
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        row = (first_m + tile % size_m) * BLOCK_M
        col = ((tile % (GROUP_M * tiles_n)) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc = tl.dot(x_desc.load([row, k]), w_desc.load([col, k]).T, acc)
        if HAS_LORA:
            for r in tl.range(0, R, BLOCK_K, num_stages=STAGES):
                acc = tl.dot(h_desc.load([row, r]), u_desc.load([col, r]).T, acc)
        out_desc.store([row, col], acc.to(out_desc.dtype))


def two_source_matmul(x: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor | None = None,
                      up: torch.Tensor | None = None, block_m: int = 128, block_n: int = 256, block_k: int = 64,
                      group_m: int = 8, num_warps: int = 8, num_stages: int = 3, programs: int | None = None
                      ) -> torch.Tensor:
    """`x` `(M, K)` @ `weight` `(N, K)`^T (+ `hidden` `(M, R)` @ `up` `(N, R)`^T), bf16 or fp16, float32
    accumulation -> `(M, N)` in `x`'s dtype."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    has_lora = hidden is not None
    if not has_lora:
        hidden, up = x, weight
    R = hidden.shape[1]
    descs = [TensorDescriptor.from_tensor(x, [block_m, block_k]),
             TensorDescriptor.from_tensor(weight, [block_n, block_k]),
             TensorDescriptor.from_tensor(hidden, [block_m, block_k]),
             TensorDescriptor.from_tensor(up, [block_n, block_k]),
             TensorDescriptor.from_tensor(out, [block_m, block_n])]
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = min(programs, tiles)
    _two_source_matmul[(programs,)](*descs, M, N, K, R, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                    GROUP_M=group_m, NUM_PROGRAMS=programs, HAS_LORA=has_lora, STAGES=num_stages,
                                    num_warps=num_warps)
    return out
