"""FP8 (e4m3) linears for the `fast` tier: weights quantized per output channel once, activations per row on the
fly, one `torch._scaled_mm` with both scale vectors and a bf16 result. On a device without FP8 GEMMs (the CPU)
the same quantized numbers are multiplied after dequantizing, so tests check the quantization itself."""

import torch
import torch.nn as nn

from h3gen.kernels.fp8_quant import Fp8Rows, quantize_rows
from h3gen.kernels.fp8_quant.reference import quantize_rows as quantize_rows_reference


class Fp8Linear(nn.Module):
    """`y = x @ W.T + b` with W stored as e4m3 plus a float32 scale per output feature."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_rows_reference(linear.weight.detach())
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
        self.bias = linear.bias
        self.compute_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x `(..., in)`, quantized here per row, or already quantized as `Fp8Rows` (from a fused kernel) ->
        `(..., out)` in the layer's original dtype."""
        if not isinstance(x, Fp8Rows):
            x = quantize_rows(x)  # keeps x's shape, one scale per row
        q, scale = x.values.reshape(-1, self.in_features), x.scale
        x = x.values
        if x.is_cuda:
            out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale,
                                   out_dtype=self.compute_dtype, bias=self.bias)
        else:
            dequant = self.weight.float() * self.weight_scale.t()
            out = ((q.float() * scale) @ dequant.t()).to(self.compute_dtype)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_block_linears(block) -> None:
    """Replace a transformer block's q/k/v/out and SwiGLU projections by `Fp8Linear`s (AdaLN stays bf16: it runs
    on 2-4 rows and is 0 % of the FLOPs)."""
    attn, ff = block.attn, block.ff
    for name in ("to_q", "to_k", "to_v"):
        setattr(attn, name, Fp8Linear(getattr(attn, name)))
    attn.to_out[0] = Fp8Linear(attn.to_out[0])
    ff.net[0].proj = Fp8Linear(ff.net[0].proj)
    ff.net[2] = Fp8Linear(ff.net[2])
