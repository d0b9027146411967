"""Full softmax attention in plain torch: what the Triton flash-attention kernel computes."""

import math

import torch


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """q, k, v `(B, H, S, D)` -> `softmax(q k^T / sqrt(D)) v`, `(B, H, S, D)` in q.dtype (float32 inside)."""
    scores = (query.float() @ key.float().transpose(-1, -2)) / math.sqrt(query.shape[-1])
    return (scores.softmax(dim=-1) @ value.float()).to(query.dtype)
