"""`MXFP4Linear`: a linear layer whose weight is held in the MXFP4 format (`h3gen.quant.mxfp4_format`) and multiplied
by the MXFP4 GEMM kernel (`h3gen.kernels.mxfp4_gemm`)."""

import torch

from h3gen.kernels.mxfp4_gemm import mxfp4_matmul
from h3gen.quant.mxfp4_format import BLOCK, dequantize, padded_width, quantize


class MXFP4Linear(torch.nn.Module):
    """`y = x @ W^T + b` with W stored as MXFP4: `weight_packed` `[N, Kp / 2]` uint8 and `weight_scale`
    `[N, Kp / 32]` uint8 (the names MXFP4 checkpoints use). A full-precision `weight` handed to
    `load_checkpoint_tensor` is quantized on the spot, so online quantization holds one layer at a time."""

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        kp = padded_width(in_features)
        self.register_buffer("weight_packed", torch.zeros(out_features, kp // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, kp // BLOCK, dtype=torch.uint8))
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        self.compute_dtype = compute_dtype

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "MXFP4Linear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        layer.set_weight(linear.weight)
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer.to(linear.weight.device)

    def set_weight(self, weight: torch.Tensor) -> None:
        packed, scales = quantize(weight)
        self.weight_packed = packed.to(
            self.weight_packed.device if self.weight_packed.device.type != "meta" else weight.device
        )
        self.weight_scale = scales.to(self.weight_packed.device)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor, device, dtype) -> bool:
        """Take a checkpoint tensor addressed to this layer: a full-precision `weight` is quantized here (and
        `dtype`, the model's working dtype, becomes the compute dtype). Returns False for tensors the loader
        should place itself (`bias`, already packed buffers)."""
        if name != "weight":
            return False
        self.weight_packed = torch.empty(0, dtype=torch.uint8, device=device)  # leave the meta device
        self.set_weight(tensor.to(device))
        self.compute_dtype = dtype
        return True

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight_packed, self.weight_scale, dtype or self.compute_dtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `(..., in)` -> `(..., out)` in x's dtype (the compute dtype)."""
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        out = mxfp4_matmul(rows, self.weight_packed, self.weight_scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
