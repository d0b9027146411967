"""RMSNorm as K3 (and transformers' Llama-style norms) compute it, in plain torch."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x` `[..., D]`, `weight` `[D]` -> `weight * (x / rms(x))`: the normalised value in float32, cast to x.dtype
    before the weight; the result in the promoted dtype of `weight` and `x`."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
