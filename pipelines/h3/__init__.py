"""MiniMax-H3: transformer, packed layout, request geometry. The transformer's names load lazily, so the light
modules of this package (geometry, continuation, step-cache knobs) import without torch."""

__all__ = ["H3Transformer", "H3TransformerConfig", "H3TransformerOutput"]


def __getattr__(name: str):
    if name == "H3TransformerConfig":
        from h3gen.pipelines.h3 import transformer_config

        return transformer_config.H3TransformerConfig
    if name in __all__:
        from h3gen.pipelines.h3 import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'h3gen.pipelines.h3' has no attribute {name!r}")
