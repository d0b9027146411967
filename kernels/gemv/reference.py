"""Few-row linears in plain torch (the decode step's projections)."""

import torch
import torch.nn.functional as F

from h3gen.kernels.rmsnorm import reference as norm_reference


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` `[..., K]` times `weight` `[N, K]` transposed -> `[..., N]` in x.dtype."""
    return F.linear(x, weight)


def grouped_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One linear per group: `x` `[G, M, K]`, `weight` `[G, N, K]` -> `[G, M, N]` (`x[g] @ weight[g].T`)."""
    return torch.bmm(x, weight.transpose(1, 2))


def normed_rows_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual update, the norm after it and the linear that reads the norm: `s = x + residual` (or `x`), then
    `(s, rows_linear(rms_norm(s, norm_weight, eps), weight))`; `x` `[..., K]`, `weight` `[N, K]`."""
    if residual is None:
        return x, rows_linear(norm_reference.rms_norm(x, norm_weight, eps), weight)
    total, normed = norm_reference.add_rms_norm(x, residual, norm_weight, eps)
    return total, rows_linear(normed, weight)
