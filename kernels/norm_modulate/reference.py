"""RMSNorm followed by the per-row AdaLN modulation, in plain torch (the reference's op order)."""

import torch
import torch.nn.functional as F


def rmsnorm_modulate(x: torch.Tensor, weight: torch.Tensor | None, shift: torch.Tensor, scale: torch.Tensor,
                     index: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x) * weight * (1 + scale[index]) + shift[index]`.

    Args:
        x: `(B, S, H)`. weight: `(H,)` or None. shift, scale: `(R, H)` tables. index: `(S,)` long rows of the tables.
    Returns:
        `(B, S, H)` in `x.dtype`.
    """
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return normed * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)
