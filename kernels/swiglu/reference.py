"""SwiGLU activation in plain torch."""

import torch
import torch.nn.functional as F

from h3gen.kernels.fp8_quant.reference import Fp8Rows, quantize_rows


def swiglu(x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    """`(..., 2F)` holding `[value; gate]` -> `(..., F)` = `value * silu(gate)`, in x.dtype; or (`fp8`) computed
    in float32 and quantized to e4m3 per row, as `Fp8Rows`."""
    if fp8:
        return quantize_rows(swiglu(x.float()))
    value, gate = x.chunk(2, dim=-1)
    return value * F.silu(gate)
