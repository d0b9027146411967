"""MiniMax-H3: transformer, packed layout, request geometry."""

from h3gen.pipelines.h3.transformer import H3Transformer, H3TransformerConfig, H3TransformerOutput

__all__ = ["H3Transformer", "H3TransformerConfig", "H3TransformerOutput"]
