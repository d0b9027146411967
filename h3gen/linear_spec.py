"""What a model asks of one linear layer (`LinearSpec`) and the shape of a factory that answers (`LinearFactory`).

This module imports nothing else of h3gen: the linears of `h3gen.parallel` read the spec, and the factory in
`h3gen.linear`, which builds every linear, sits above them.
"""

from dataclasses import dataclass
from typing import Callable, Literal

import torch.nn as nn

# How a projection may be split across tensor-parallel ranks (Megatron style):
#   "column"     - output features sharded (q/k/v, SwiGLU up): no communication, feeds a "row" layer.
#   "row"        - input features sharded (attention out, SwiGLU down): partial sums all-reduced.
#   "replicated" - every rank holds the whole layer (embedders, heads, AdaLN, fp32 islands).
ParallelRole = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class LinearSpec:
    """What a model asks of one linear layer.

    `kind` says what the projection is for (e.g. "attn.qkv", "attn.out", "ffn.up", "ffn.down", "adaln", "embed",
    "head", "time"), so factories can treat classes of layers alike (quantize the block GEMMs, never the heads).
    `fp32` marks the checkpoint's float32 islands, which every factory must keep dense and float32. `splits` and
    `gather_output` tell a tensor-parallel factory how to shard a column-parallel layer.
    """

    in_features: int
    out_features: int
    bias: bool
    role: ParallelRole = "replicated"
    kind: str = "other"
    fp32: bool = False
    # For "column": the logical sub-matrices stacked along the output (e.g. SwiGLU's [value; gate]), each sharded
    # on its own so every rank keeps matching halves; None = one matrix.
    splits: tuple[int, ...] | None = None
    # For "column": all-gather the sharded output so every rank sees the whole (the AdaLN table).
    gather_output: bool = False


LinearFactory = Callable[[LinearSpec], nn.Module]
