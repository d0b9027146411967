"""K-extended LoRA: the update inside the layer's own GEMM, `y = [x | x A^T] @ [W | scale B]^T`.

A separate pass for the update reads or writes every adapted output once more; the rank-`r` columns added to the
GEMM's K loop cost `r / in_features` more multiply-adds and no extra pass over the output (benchmarks/RESULTS.md).
That needs both operands laid out side by side:

- the weight: while an adapter set is attached, a K-extended dense layer's weight lives in an `(out, in + end)`
  buffer whose first `in` columns are the layer's weight (its parameter is a view of them, so nothing holds a
  second copy) and whose last `end` columns hold its adapters' `scale * B`, under the group's projected-input
  columns `[0, end)` its adapters' A's fill. Detaching copies the weight back to a tensor of its own;
- the input: the kernel that produces a group's shared input writes it into the first `in` columns of a
  `(rows, in + R)` buffer (`LoraGroup.wide_input`), and the group writes `x A^T` (every member's A, as its
  projected input) into the rest. A member reads columns `[0, in + end)`, `end` its last A column.
"""

import torch


def extended_weight(weight: torch.Tensor, columns: list[tuple[torch.Tensor, int]], extra: int) -> torch.Tensor:
    """`(out, in + extra)` in `weight`'s dtype and device: `weight` `(out, in)`, then zeros except each
    `(block (out, w), column)` of `columns` placed at `in + column`."""
    out_features, in_features = weight.shape
    wide = torch.zeros(out_features, in_features + extra, dtype=weight.dtype, device=weight.device)
    wide[:, :in_features].copy_(weight)
    for block, column in columns:
        wide[:, in_features + column : in_features + column + block.shape[1]].copy_(block)
    return wide
