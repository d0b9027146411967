"""The AdaLN-gated residual update, alone and followed by the next RMSNorm + modulation, in plain torch."""

import torch

from h3gen.kernels.norm_modulate.reference import rmsnorm_modulate


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x + gate[index] * y`; x, y `(B, S, H)`, gate `(R, H)`, index `(S,)`. Returns `(B, S, H)` in x.dtype."""
    return x + gate.index_select(0, index) * y


def gated_residual_norm_modulate(x, y, gate, index, weight, shift, scale, eps, fp8=False):
    """`x_new = x + gate[index] * y` and `rmsnorm_modulate(x_new, ..., fp8=fp8)`: the residual update of one
    half-block and the input of the next. Returns `(x_new, modulated)`."""
    x_new = gated_residual(x, y, gate, index)
    return x_new, rmsnorm_modulate(x_new, weight, shift, scale, index, eps, fp8=fp8)
