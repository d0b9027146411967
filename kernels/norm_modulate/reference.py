"""RMSNorm followed by the per-row AdaLN modulation, in plain torch (the reference's op order)."""

import torch
import torch.nn.functional as F

from h3gen.kernels.fp8_quant.reference import Fp8Rows, quantize_rows


def rmsnorm_modulate(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor,
    eps: float,
    fp8: bool = False,
) -> torch.Tensor | Fp8Rows:
    """`rms_norm(x) * weight * (1 + scale[index]) + shift[index]`.

    Args:
        x: `(B, S, H)`. weight: `(H,)` or None. shift, scale: `(R, H)` tables. index: `(S,)` long rows of the tables.
        fp8: return the result quantized to e4m3 per row (computed in float32 first), for an FP8 GEMM.
    Returns:
        `(B, S, H)` in `x.dtype`, or `Fp8Rows` with `(B * S, 1)` scales.
    """
    if fp8:
        return quantize_rows(
            rmsnorm_modulate(
                x.float(), None if weight is None else weight.float(), shift.float(), scale.float(), index, eps
            )
        )
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return normed * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)
