"""MXFP4-weight GEMM on CUDA: `mxfp4_matmul` picks a path by rows of activations.

- 1-16 rows of bf16 on a CUDA GPU with K a multiple of 128, `few_rows` (`kernels.mxfp4_gemm.gluon`, written in
  Gluon): the packed words loaded straight into the MMA's operand registers, no shared memory; 1.4-2.1x bf16
  cuBLAS at the H3 shapes on the H200, ahead of the two paths below (benchmarks/RESULTS.md). The paths below remain
  for the other cases and for the interpreter.
- one row, `gemv` (`triton_gemv`): CUDA-core products with the weights decoded from 32-bit words (three integer
  operations per weight); bound by the decode's integer issue rate, faster than bf16 cuBLAS there.
- 2-16 rows of bf16, `pair_matmul` (`triton_pairs`): tensor cores, each word decoded by inline PTX into bf16 pairs
  already in the MMA's operand registers. fp16 takes the `tl.dot_scaled` path (`triton_scaled.scaled_matmul`).
- fused (`triton_fused.fused_matmul`): the E2M1 nibbles and E8M0 scales read and dequantized inside a tiled GEMM,
  float32 accumulation; the fallback for a few rows of any dtype (float32 activations).
- dequantize + cuBLAS (`triton_decode.dequantize`): for thousands of rows the GEMM is bound by tensor-core
  throughput, and rebuilding every weight tile once per row tile costs more than writing the whole bf16 weight once
  (about 0.1 ms for the largest H3 weight) and handing it to cuBLAS. The bf16 copy lives only for the call.
"""

import torch

from h3gen.kernels.mxfp4_gemm import gluon
from h3gen.kernels.mxfp4_gemm.triton_decode import dequantize
from h3gen.kernels.mxfp4_gemm.triton_fused import default_config, fused_matmul
from h3gen.kernels.mxfp4_gemm.triton_gemv import gemv
from h3gen.kernels.mxfp4_gemm.triton_pairs import pair_matmul
from h3gen.kernels.mxfp4_gemm.triton_scaled import SCALED_DOT_FORMATS, scaled_matmul

# Rows at and above which `mxfp4_matmul` dequantizes once and calls cuBLAS: the in-kernel paths lose to it there
# (on the H200 at 256 rows of 5376x7168 the scaled dot took 0.336 ms, dequantize + cuBLAS 0.058 ms).
DEQUANT_MIN_ROWS = 17
# Tiles of the `tl.dot_scaled` path for 2-16 rows of fp16 activations (bf16 takes `pair_matmul`, 1.4-2x faster on
# the H200): 1.15-1.23x the fused kernel's speed there; at 256 rows and more it is 10x slower than cuBLAS.
SCALED_SMALL_M = dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)


def mxfp4_matmul(x, packed, scales, *, path: str = "auto", **config):
    """Same contract as `reference.mxfp4_matmul`: `x` `[M, K]` (bf16/fp16/fp32) times the dequantized `[N, Kp]`
    weight (`packed` `[N, Kp / 2]`, `scales` `[N, Kp / 32]` uint8) transposed -> `[M, N]` in x.dtype.

    `path`: "few_rows" (1-16 rows of bf16, Gluon: `gluon.few_rows_matmul`), "fused" (in-kernel dequantization),
    "gemv" (one row, no tensor cores), "pairs" (up to 16 rows on the tensor cores, `pair_matmul`), "scaled"
    (`tl.dot_scaled`, bf16/fp16 activations), "dequant" (dequantize then `torch.matmul`) or "auto" (up to 16 rows of
    bf16 where `gluon.supports` them: few_rows; else one row: the GEMV; up to `DEQUANT_MIN_ROWS` rows: pairs for
    bf16 with K a multiple of 8, the scaled dot for fp16, else fused; more: dequant). `config` overrides the
    chosen path's tiles."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    if path == "few_rows" or (
        path == "auto" and m <= gluon.MAX_ROWS and not config and gluon.supports(x, packed, scales)
    ):
        return gluon.few_rows_matmul(x, packed, scales, **config)
    if path == "gemv" or (path == "auto" and m == 1):
        if m != 1:
            raise ValueError(f"the gemv path takes one row of activations, got {m}.")
        return gemv(x, packed, scales, **config)
    if path == "pairs" or (
        path == "auto" and 1 < m < DEQUANT_MIN_ROWS and x.dtype == torch.bfloat16 and k % 8 == 0 and not config
    ):
        return pair_matmul(x, packed, scales, **config)
    if path == "scaled":
        return scaled_matmul(x, packed, scales, **config)
    if path == "auto" and m < DEQUANT_MIN_ROWS and x.dtype in SCALED_DOT_FORMATS and not config:
        return scaled_matmul(x, packed, scales, **SCALED_SMALL_M)
    if path == "dequant" or (path == "auto" and m >= DEQUANT_MIN_ROWS and not config):
        return x @ dequantize(packed, scales, x.dtype, k).t()
    return fused_matmul(x, packed, scales, **{**default_config(m, n, k), **config})
