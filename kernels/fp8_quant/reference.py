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


def copy_rows(out, result):
    """Write a row kernel's `result` (a tensor, or `Fp8Rows`) into `out` (the same kind and shape; values may be a
    column slice of a wider buffer) and return `out`."""
    if isinstance(out, Fp8Rows):
        out.values.copy_(result.values)
        out.scale.copy_(result.scale)
    else:
        out.copy_(result)
    return out


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` saturated to +-448 and rounded to e4m3 (float32 math)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """`(M, K)` (or `(..., K)`) -> `Fp8Rows`, scale = amax(row) / 448 (at least 1e-12 / 448)."""
    rows = x.reshape(-1, x.shape[-1])
    scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return Fp8Rows(to_fp8(rows, scale).reshape(x.shape), scale)


def head_descales(x: torch.Tensor) -> torch.Tensor:
    """`(B, S, H, D)` -> `(B, H)` float32: each head's amax over its rows and channels / 448 (at least 1e-12 / 448),
    the scale that maps the head onto e4m3's range."""
    return x.abs().amax(dim=(1, 3)).float().clamp_min(1e-12) / FP8_MAX


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, S, H, D)` -> e4m3 values of the same shape and `(B, H)` float32 descales, x ~= values * descale
    (`head_descales`): FlashAttention-3's FP8 input contract."""
    scale = head_descales(x)
    return to_fp8(x, scale[:, None, :, None]), scale


def append_scaled_columns(
    values: torch.Tensor, scale: torch.Tensor, projected: torch.Tensor, factors: torch.Tensor
) -> None:
    """Fill the last `R` columns of e4m3 rows `values` `(M, K + R)` (their first `K` columns quantized with `scale`
    `(M, 1)` float32) with `projected / factors` (`projected` `(M, R)` float, already divided by the row scale;
    `factors` `(R,)` float32), in place. A row whose new columns would pass 448 takes the power of two `t` that
    keeps them within it: its scale is multiplied by `t` and its first `K` values divided by `t` (exact, but for
    values that become subnormal)."""
    width = values.shape[1] - projected.shape[1]
    extra = projected.float() / factors.reshape(1, -1)
    peak = extra.abs().amax(dim=1, keepdim=True)
    t = torch.exp2(torch.ceil(torch.log2(peak / FP8_MAX)).clamp_min(0.0))
    values[:, :width] = (values[:, :width].float() / t).to(FP8)
    values[:, width:] = (extra / t).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scale.mul_(t)
