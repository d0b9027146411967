"""Per-row FP8 (e4m3) quantization in plain torch."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(M, K)` -> (`(M, K)` e4m3, `(M, 1)` float32 scales), `x ~= q * scale`, scale = amax(row) / 448."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
