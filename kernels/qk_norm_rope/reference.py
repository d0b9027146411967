"""Per-head RMSNorm of q and k followed by rotate-half RoPE on the leading channels, in plain torch (the
reference's op order: the norm's output is rounded before the rotation)."""

import torch
import torch.nn.functional as F


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, heads_first: bool = False):
    """Args:
        q, k: `(B, S, heads, D)`. weight_q, weight_k: `(D,)`. cos, sin: `(S, R)` float32, R <= D, R even.
        heads_first: return `(B, heads, S, D)` contiguous (the layout attention kernels read) instead.
    Returns:
        `(q, k)` in the input dtype.
    """
    q = _rope(F.rms_norm(q, (q.shape[-1],), weight_q, eps), cos, sin)
    k = _rope(F.rms_norm(k, (k.shape[-1],), weight_k, eps), cos, sin)
    if heads_first:
        return q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q.contiguous(), k.contiguous()
