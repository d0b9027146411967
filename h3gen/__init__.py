"""h3gen: a serving system for MiniMax-H3 (joint video + stereo-audio diffusion).

Public API: `H3Pipeline` / `H3Output` (generation), `H3Transformer`, `tiny_checkpoint` (the demo model),
`RequestError`, `CheckpointError`. Heavy modules are imported lazily so `import h3gen` stays light.
"""

from importlib.metadata import PackageNotFoundError, version

from h3gen.errors import CheckpointError, RequestError

try:
    __version__ = version("h3gen")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

_LAZY = {
    "H3Pipeline": "h3gen.pipelines.h3.pipeline",
    "H3Output": "h3gen.pipelines.h3.pipeline",
    "H3Transformer": "h3gen.pipelines.h3.transformer",
    "H3TransformerConfig": "h3gen.pipelines.h3.transformer",
    "tiny_checkpoint": "h3gen.pipelines.h3.tiny",
}

__all__ = ["CheckpointError", "RequestError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h3gen' has no attribute {name!r}")
