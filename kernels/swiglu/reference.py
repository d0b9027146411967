"""SwiGLU activation in plain torch."""

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`(..., 2F)` holding `[value; gate]` -> `(..., F)` = `value * silu(gate)`, in x.dtype."""
    value, gate = x.chunk(2, dim=-1)
    return value * F.silu(gate)
