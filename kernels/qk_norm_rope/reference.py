"""Per-head RMSNorm of q and k followed by rotate-half RoPE on the leading channels, in plain torch (the
reference's op order: the norm's output is rounded before the rotation)."""

import math

import torch
import torch.nn.functional as F

from h3gen.kernels.fp8_quant.reference import FP8_MAX, to_fp8


def fp8_scale(weight: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale, `(1,)` float32, for q or k after RMSNorm with `weight` `(D,)` and RoPE: a normalised head
    has L2 norm sqrt(D), the weight stretches a channel by at most max|w| and the rotation mixes pairs without
    growing them, so |value| <= sqrt(D) * max|w| and that bound maps to 448. A fixed scale needs no pass over the
    rows; e4m3's relative precision is the same anywhere in its normal range, so it costs no accuracy."""
    return (weight.detach().float().abs().amax() * math.sqrt(weight.shape[-1]) / FP8_MAX).reshape(1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


def _norm_rope(x, weight, cos, sin, eps, heads_first):
    x = _rope(F.rms_norm(x, (x.shape[-1],), weight, eps), cos, sin)
    return (x.transpose(1, 2) if heads_first else x).contiguous()


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    weight_q: torch.Tensor,
    weight_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    heads_first: bool = False,
    fp8: bool = False,
):
    """Args:
        q, k: `(B, S, heads, D)`. weight_q, weight_k: `(D,)`. cos, sin: `(S, R)` float32, R <= D, R even.
        heads_first: return `(B, heads, S, D)` contiguous (the layout attention kernels read) instead.
        fp8: compute in float32 and quantize to e4m3 with `fp8_scale(weight)` (FP8 attention's inputs).
    Returns:
        `(q, k)` in the input dtype; with `fp8`, `((q, q_descale), (k, k_descale))`, e4m3 values and `(B, heads)`
        float32 descales.
    """
    if not fp8:
        return tuple(_norm_rope(x, w, cos, sin, eps, heads_first) for x, w in ((q, weight_q), (k, weight_k)))
    out = []
    for x, weight in ((q, weight_q), (k, weight_k)):
        scale = fp8_scale(weight)
        values = to_fp8(_norm_rope(x.float(), weight.float(), cos, sin, eps, heads_first), scale)
        out.append((values, scale.expand(x.shape[0], x.shape[2]).contiguous()))
    return tuple(out)
