"""LoRA on any linear layer, format-agnostic: adapters applied unmerged at forward time (`y = base(x) + scale *
(x A^T) B^T` per adapter, stacked), or merged into dense weights where bf16 rounding keeps the update.

Works on every linear `h3gen.linear` makes: dense `nn.Linear` (any float dtype), `Fp8Linear`, `MXFP4Linear` and the
tensor-parallel shards of `h3gen.parallel.tp_linear`. Which file keys name which module is the model's business
(`h3gen.pipelines.h3.lora_formats` for MiniMax-H3).
"""

from h3gen.lora.layers import (
    AUTO_MERGE_MAX_ROUNDING_LOSS,
    LoraFactors,
    LoraGroup,
    attach_group,
    detach_all,
    merge_delta,
    merge_factors,
    rounding_loss,
    shard_factors,
    wide_input,
)

__all__ = [
    "AUTO_MERGE_MAX_ROUNDING_LOSS",
    "LoraFactors",
    "LoraGroup",
    "attach_group",
    "detach_all",
    "merge_delta",
    "merge_factors",
    "rounding_loss",
    "shard_factors",
    "wide_input",
]
