"""FP8 (e4m3) quantization in plain torch: per row (GEMM activations), per (batch, head) (attention inputs) and
with a given scale (q and k after their RMSNorm, whose magnitude is bounded)."""

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class Fp8Rows(NamedTuple):
    """An activation quantized per row: `values` `(..., K)` e4m3 and `scale` `(M, 1)` float32 for the M rows of
    `values.reshape(-1, K)`; the activation is `values * scale`."""

    values: torch.Tensor
    scale: torch.Tensor


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` saturated to +-448 and rounded to e4m3 (float32 math)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """`(M, K)` (or `(..., K)`) -> `Fp8Rows`, scale = amax(row) / 448 (at least 1e-12 / 448)."""
    rows = x.reshape(-1, x.shape[-1])
    scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return Fp8Rows(to_fp8(rows, scale).reshape(x.shape), scale)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, S, H, D)` -> e4m3 values of the same shape and `(B, H)` float32 descales, x ~= values * descale
    (descale = amax over the head's rows and channels / 448): FlashAttention-3's FP8 input contract."""
    scale = x.abs().amax(dim=(1, 3)).float().clamp_min(1e-12) / FP8_MAX
    return to_fp8(x, scale[:, None, :, None]), scale
