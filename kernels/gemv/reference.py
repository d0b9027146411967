"""Few-row linears in plain torch (the decode step's projections)."""

import torch
import torch.nn.functional as F


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `[..., K]` times `weight` `[N, K]` transposed -> `[..., N]` in x.dtype."""
    return F.linear(x, weight)


def grouped_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One linear per group: `x` `[G, M, K]`, `weight` `[G, N, K]` -> `[G, M, N]` (`x[g] @ weight[g].T`)."""
    return torch.bmm(x, weight.transpose(1, 2))
