"""FP8 (e4m3) linears for the `fast` tier: weights quantized per output channel once, activations per row on the
fly, one `torch._scaled_mm` with both scale vectors and a bf16 result. On a device without FP8 GEMMs (the CPU)
the same quantized numbers are multiplied after dequantizing, so tests check the quantization itself."""

import torch
import torch.nn as nn

from h3gen.kernels.fp8_quant import Fp8Rows, quantize_rows
from h3gen.kernels.fp8_quant.reference import quantize_rows as quantize_rows_reference


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[out, in]` as e4m3 `[out, in]` and its float32 scale per output feature `[1, out]`."""
    values, scale = quantize_rows_reference(weight.detach())
    return values, scale.reshape(1, -1).contiguous()


def fp8_matmul(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for an e4m3 `weight` `[out, in]` with `weight_scale` `[1, out]`: x `(..., in)` (quantized
    here per row) or `Fp8Rows` (from a fused kernel) -> `(..., out)` in `out_dtype`. One `torch._scaled_mm` on a
    GPU; elsewhere the same quantized numbers multiplied after dequantizing."""
    if not isinstance(x, Fp8Rows):
        x = quantize_rows(x)  # keeps x's shape, one scale per row
    q, scale, shape = x.values.reshape(-1, weight.shape[1]), x.scale, x.values.shape
    if q.is_cuda:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype, bias=bias)
    else:
        dequant = weight.float() * weight_scale.t()
        out = ((q.float() * scale) @ dequant.t()).to(out_dtype)
        if bias is not None:
            out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """`y = x @ W.T + b` with W stored as e4m3 plus a float32 scale per output feature."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = fp8_weight(linear.weight)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        self.compute_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x `(..., in)`, quantized here per row, or already quantized as `Fp8Rows` (from a fused kernel) ->
        `(..., out)` in the layer's original dtype."""
        return fp8_matmul(x, self.weight, self.weight_scale, self.bias, self.compute_dtype)
