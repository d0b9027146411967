"""K-extended LoRA: the update inside the layer's own GEMM, `[x | x A^T] @ [W | scale B]^T`.

Added after the GEMM, or written first for the GEMM to add into, an update reads and writes every adapted output
once more; as `rank` more columns of the GEMM's K loop it moves no output again (its cost per GEMM and per step:
benchmarks/RESULTS.md). That needs both operands side by side:

- the weight: once an input comes through `LoraGroup.wide_input`, a member's weight lives in an `(out, in + end)`
  buffer whose first `in` columns are the layer's weight (its parameter or buffer a view of them, so nothing holds a
  second copy) and whose last `end` columns hold its adapters' `scale * B` under the group's projected columns
  `[0, end)` (zeros under the other members'). Detaching copies the weight back to a tensor of its own;
- the input: the kernel producing the group's shared input writes its rows into the first `in` columns of a
  `(rows, in + R)` buffer, and the group writes `x A^T` into the rest.

Dense layers (bf16, fp16, float32) hold `scale * B` and `x A^T` as they are. For FP8 layers one scale per input
row (`s_row`) and per output feature (`s_col`) then covers those columns too, so a projected column `j` is stored as
`x A^T / (s_row c_j)` and its B column as `scale * B * c_j / s_col`, for a factor `c_j` per column fixed when the
weight is extended. `column_factors` picks it so that the B column's largest value is at most 448 and, as far as
that allows, balanced against an estimate of the projected column's (448 times the A row's norm), keeping both well
inside e4m3's range. Where an input row's projected values still pass 448, that row's scale grows by a power of two
(`h3gen.kernels.fp8_quant.append_scaled_columns`), so nothing saturates; only values of that row which become
subnormal lose precision.
"""

import torch

from h3gen.kernels.fp8_quant import FP8, FP8_MAX


def column_factors(peaks: torch.Tensor, down_norms: torch.Tensor) -> torch.Tensor:
    """The factors `c` `(R,)` float32 of a group's projected columns: `peaks` `(R,)` the largest `|scale B / s_col|`
    over the output features of every member reading each column (0 where none does), `down_norms` `(R,)` the L2
    norms of the A rows. `c = min(448 / peak, sqrt(448 * norm / peak))`, 1 where that is not a positive number."""
    peaks, down_norms = peaks.float(), down_norms.float()
    factors = torch.minimum(FP8_MAX / peaks, torch.sqrt(FP8_MAX * down_norms / peaks))
    return torch.where(torch.isfinite(factors) & (factors > 0), factors, torch.ones_like(factors))


def up_columns(up: torch.Tensor, weight_scale: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """`scale * B` columns `up` `(out, w)` as the e4m3 extra columns of a weight with `weight_scale` `(1, out)`:
    `up * c / s_col` (within +-448 by the choice of `factors` `(w,)`)."""
    values = up.float() * factors.reshape(1, -1) / weight_scale.reshape(-1, 1).float()
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def extended_weight(weight: torch.Tensor, columns: list[tuple[torch.Tensor, int]], extra: int) -> torch.Tensor:
    """`(out, in + extra)` in `weight`'s dtype and device: `weight` `(out, in)`, then zeros except each
    `(block (out, w), column)` of `columns` placed at `in + column`."""
    out_features, in_features = weight.shape
    wide = torch.zeros(out_features, in_features + extra, dtype=weight.dtype, device=weight.device)
    wide[:, :in_features].copy_(weight)
    for block, column in columns:
        wide[:, in_features + column : in_features + column + block.shape[1]].copy_(block)
    return wide
