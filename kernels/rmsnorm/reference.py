"""RMSNorm as K3 (and transformers' Llama-style norms) compute it, in plain torch."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` `[..., D]`, `weight` `[D]` -> `weight * (x / rms(x))`: the normalised value in float32, cast to x.dtype
    before the weight; the result in the promoted dtype of `weight` and `x`, then cast to `out_dtype` when given
    (a float32 norm handing bf16 to a GEMM, as `norm(x.float()).to(bf16)`)."""
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if out_dtype is None else out.to(out_dtype)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual update and the next sub-layer's norm: `(s, rms_norm(s, weight, eps))` with `s = x + y` (rounded
    to its dtype first, as the separate add would be)."""
    total = x + y
    return total, rms_norm(total, weight, eps)
