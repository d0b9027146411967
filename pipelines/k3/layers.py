"""Building blocks the K3 model's layers share: RMSNorm, the short convolution, the gated activations, and the
projections of a decode step (linears fused by concatenation, few-row GEMVs, norms applied inside the projection's
kernel through `PendingNorm`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.argmax import argmax_rows
from h3gen.kernels.rmsnorm import rms_norm
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.pending_norm import PendingNorm, linear_rows, linear_rows_argmax, resolved


class K3RMSNorm(nn.Module):
    """RMSNorm computed in float32; the normalised value is cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class K3ShortConv(nn.Module):
    """Holder of one depthwise causal conv weight `[C, 1, W]` (float32, as K3 stores and uses it)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width))


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU: `beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta)`, float32, cast back."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def gated_activation(config: K3Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "situ":
        return situ_and_mul(gate, up, config.situ_beta, config.situ_linear_beta)
    return F.silu(gate) * up


@torch.no_grad()
def fuse_linears(layers: list[nn.Module]) -> torch.Tensor | None:
    """Move the weights of plain bias-free `nn.Linear`s that read the same input into one `[sum of outputs, in]`
    tensor and point each layer's weight at its rows of it, so one GEMM computes them all (`F.linear(x, fused)`
    split by output widths); state-dict keys and values do not change. None, changing nothing, when any layer is
    something else (quantized, tensor parallel, with a bias) or they differ in input width, dtype or device."""
    if not layers or any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
        return None
    first = layers[0].weight
    if any(
        layer.weight.shape[1] != first.shape[1]
        or layer.weight.dtype != first.dtype
        or layer.weight.device != first.device
        for layer in layers
    ):
        return None
    fused = first.new_empty(sum(layer.weight.shape[0] for layer in layers), first.shape[1])
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        fused[start : start + rows].copy_(layer.weight)
        layer.weight.data = fused[start : start + rows]
        start += rows
    return fused


@torch.no_grad()
def stack_linears(layers: list[nn.Module]) -> torch.Tensor | None:
    """Like `fuse_linears` for bias-free linears of one shape that read different inputs: their weights moved into
    one `[len(layers), out, in]` tensor (each layer's weight re-pointed at its slice), for one batched GEMM. None,
    changing nothing, when they are not all plain `nn.Linear`s of one shape, dtype and device."""
    if not layers or any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
        return None
    first = layers[0].weight
    if any(
        layer.weight.shape != first.shape or layer.weight.dtype != first.dtype or layer.weight.device != first.device
        for layer in layers
    ):
        return None
    stacked = torch.stack([layer.weight for layer in layers])
    for layer, weight in zip(layers, stacked, strict=True):
        layer.weight.data = weight
    return stacked


def fused_outputs(fused: torch.Tensor, layers: list[nn.Module], x: torch.Tensor | PendingNorm) -> list[torch.Tensor]:
    """The outputs of `layers` (fused by `fuse_linears`) for `x`, from one GEMM (`rows_linear`; for a pending norm,
    the GEMM computes the norm)."""
    return list(linear_rows(x, fused).split([layer.weight.shape[0] for layer in layers], dim=-1))


def project(layer: nn.Module, x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """`layer(x)`, where a plain bias-free `nn.Linear` goes through `rows_linear`: a decode step's few rows then take
    the few-row kernel (`h3gen.kernels.gemv`), anything else `F.linear` as before. Other linears (quantized,
    tensor parallel) are called as they are."""
    if type(layer) is nn.Linear and layer.bias is None:
        return linear_rows(x, layer.weight)
    return layer(resolved(x))


def project_argmax(
    layer: nn.Module, x: torch.Tensor | PendingNorm, into: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`project(layer, x)` `[..., N]`, its argmax over N `[...]` int64, written into `into` (contiguous, one per
    row) when given); for a decode step's few rows through a plain linear, the GEMV kernel finds the argmax as it
    writes the output (`rows_linear_argmax`)."""
    if type(layer) is nn.Linear and layer.bias is None:
        return linear_rows_argmax(x, layer.weight, into)
    out = layer(resolved(x))
    index = argmax_rows(out.reshape(-1, out.shape[-1]))
    if into is not None:
        index = into.copy_(index)
    return out, index.view(out.shape[:-1])
