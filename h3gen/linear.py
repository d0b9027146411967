"""The one place model code gets its linear layers from.

Models never call `nn.Linear` directly: they describe each projection with a `LinearSpec` and ask a factory for
the module. `dense_linear` returns a plain `nn.Linear`; `make_linear_factory` adds tensor parallelism
(`h3gen.parallel`) and MXFP4 weights (`h3gen.quant`), and `to_fp8` / `to_mxfp4` turn a layer into its FP8 / MXFP4
form. Every variant keeps the parameter names of `nn.Linear` (or the MXFP4 checkpoint names), so state-dict keys
never change.
"""

import torch.nn as nn

from h3gen.linear_spec import LinearFactory, LinearSpec, ParallelRole
from h3gen.parallel.state import ParallelState
from h3gen.parallel.tp_linear import (
    ColumnParallelLinear,
    ColumnParallelMXFP4Linear,
    RowParallelLinear,
    RowParallelMXFP4Linear,
)
from h3gen.quant.fp8 import Fp8Linear
from h3gen.quant.mxfp4 import MXFP4Linear

__all__ = [
    "LinearFactory",
    "LinearSpec",
    "MXFP4_KINDS",
    "ParallelRole",
    "dense_linear",
    "make_linear_factory",
    "to_fp8",
    "to_mxfp4",
]

QUANTIZATIONS = ("mxfp4",)
# The block linears `quantization="mxfp4"` stores as MXFP4 by default (float32 islands, embedders and heads stay
# dense).
MXFP4_KINDS = ("attn.qkv", "attn.out", "ffn.up", "ffn.down", "adaln")


def dense_linear(spec: LinearSpec) -> nn.Linear:
    """The default factory: a plain `nn.Linear(in_features, out_features, bias)`."""
    return nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)


def make_linear_factory(
    *,
    parallel: ParallelState | None = None,
    quantization: str | None = None,
    quantized_kinds: tuple[str, ...] = MXFP4_KINDS,
    base: LinearFactory | None = None,
) -> LinearFactory:
    """A `LinearFactory` for one model.

    - `quantization="mxfp4"`: specs whose `kind` is in `quantized_kinds` (never float32 islands) become
      `MXFP4Linear`s, or, under tensor parallelism, column / row TP linears holding MXFP4 shards.
    - every other spec: `base(spec)` when `base` is given; else, with `parallel` of TP degree > 1, column / row
      roles become `ColumnParallelLinear` / `RowParallelLinear` (float32 islands and replicated layers stay
      dense); else a dense `nn.Linear`.
    """
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None (got {quantization!r}).")
    sharded = parallel is not None and parallel.tp > 1

    def make(spec: LinearSpec) -> nn.Module:
        split = sharded and spec.role in ("column", "row")
        if quantization == "mxfp4" and not spec.fp32 and spec.kind in quantized_kinds:
            if split:
                return (ColumnParallelMXFP4Linear if spec.role == "column" else RowParallelMXFP4Linear)(spec, parallel)
            return MXFP4Linear(spec.in_features, spec.out_features, spec.bias)
        if base is not None:
            return base(spec)
        if split and not spec.fp32:
            return (ColumnParallelLinear if spec.role == "column" else RowParallelLinear)(spec, parallel)
        return dense_linear(spec)

    return make


def to_fp8(layer: nn.Module) -> nn.Module | None:
    """`layer` with FP8 (e4m3) weights, for the `fast` tier: a dense `nn.Linear` becomes an `Fp8Linear`, a
    tensor-parallel linear quantizes its own shard in place (keeping its collectives) and is returned; None for a
    layer whose weights are stored otherwise (an MXFP4 layer keeps its 4-bit weights)."""
    if hasattr(layer, "weight_packed"):
        return None
    if isinstance(layer, nn.Linear):
        return Fp8Linear(layer)
    if hasattr(layer, "quantize_fp8"):
        layer.quantize_fp8()
        return layer
    raise TypeError(f"cannot quantize a {type(layer).__name__} to FP8 for the fast tier.")


def to_mxfp4(layer: nn.Linear) -> MXFP4Linear:
    """A dense `nn.Linear` as an `MXFP4Linear` on the same device, its weight quantized (compute dtype: the
    weight's dtype)."""
    return MXFP4Linear.from_linear(layer)
