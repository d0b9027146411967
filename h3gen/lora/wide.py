"""K-extended LoRA: the update inside the layer's own GEMM, `[x | x A^T] @ [W | scale B]^T`.

Added after the GEMM, or written first for the GEMM to add into, an update reads and writes every adapted output
once more; as `rank` more columns of the GEMM's K loop it moves no output again (its cost per GEMM and per step:
benchmarks/RESULTS.md). That needs both operands side by side:

- the input: the kernel producing the group's shared input writes its rows into columns `[L, L + in)` of a
  `(rows, L + in + R)` buffer, and the group writes `x A^T` into the last R columns; L is 0, or the width of the
  first member's own projected columns, which the group then also copies left of x (`LoraGroup._lay_out_wide`);
- the weight: once an input comes through `LoraGroup.wide_input`, a member reads one window of that buffer, x and
  the projected columns on one side of it up to its last own one, and its weight lives in an `(out, window)` buffer
  holding the layer's weight under x (its parameter or buffer a view of those columns, so nothing holds a second
  copy) and its adapters' `scale * B` under its own projected columns (zeros under the other members'). Detaching
  copies the weight back to a tensor of its own.

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


def extended_weight(weight: torch.Tensor, columns: list[tuple[torch.Tensor, int]], at: int, width: int) -> torch.Tensor:
    """`(out, width)` in `weight`'s dtype and device: `weight` `(out, in)` in columns `[at, at + in)`, each
    `(block (out, w), column)` of `columns` in `[column, column + w)`, zeros elsewhere."""
    out_features, in_features = weight.shape
    wide = torch.zeros(out_features, width, dtype=weight.dtype, device=weight.device)
    wide[:, at : at + in_features].copy_(weight)
    for block, column in columns:
        wide[:, column : column + block.shape[1]].copy_(block)
    return wide
