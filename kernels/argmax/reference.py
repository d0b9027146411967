"""The row argmax as torch computes it: the first index of the largest value, a NaN counting as the largest."""

import torch


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `[B, V]` -> `[B]` int64: each row's first index of its maximum (its first NaN, if it has one)."""
    return x.argmax(dim=-1)
