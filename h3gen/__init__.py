"""h3gen: a serving system for MiniMax-H3 (joint video + stereo-audio diffusion).

Public API: `H3Pipeline` / `H3Output` (generation), `GenerationRequest` (what one clip is asked to be),
`ImageReference` / `VideoReference` / `AudioReference` (ref2va references), `RunOptions` (how a model loads and
runs), `H3Transformer`, `tiny_checkpoint` (the demo model), `read_lora` / `LoraFile` (what a LoRA file holds, see
docs/lora.md), `RequestError`, `CheckpointError`. Heavy modules are imported lazily so `import h3gen` stays light.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path as _Path

from h3gen.errors import CheckpointError, RequestError

try:
    __version__ = version("h3gen")
except PackageNotFoundError:  # a source checkout that is not installed
    __version__ = "0.0.0+source"

# Run from a source checkout (PYTHONPATH=<checkout>, as on the GPU machine): an install maps kernels/, pipelines/,
# offload/ and ui/ under h3gen (pyproject.toml); here the checkout root serves as a second location of h3gen's
# subpackages instead. Only in a checkout (pyproject.toml beside), never in site-packages, where a top-level
# `kernels` may belong to another distribution.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").exists() and (_root / "kernels" / "__init__.py").exists() and str(_root) not in __path__:
    __path__.append(str(_root))

_LAZY = {
    "H3Pipeline": "h3gen.pipelines.h3.pipeline",
    "H3Output": "h3gen.pipelines.h3.output",
    "GenerationRequest": "h3gen.pipelines.h3.generation",
    "ImageReference": "h3gen.pipelines.h3.references",
    "VideoReference": "h3gen.pipelines.h3.references",
    "AudioReference": "h3gen.pipelines.h3.references",
    "RunOptions": "h3gen.options",
    "H3Transformer": "h3gen.pipelines.h3.transformer",
    "H3TransformerConfig": "h3gen.pipelines.h3.transformer_config",
    "tiny_checkpoint": "h3gen.pipelines.h3.tiny_checkpoint",
    "read_lora": "h3gen.pipelines.h3.lora_formats",
    "LoraFile": "h3gen.pipelines.h3.lora_formats",
}

__all__ = ["CheckpointError", "RequestError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h3gen' has no attribute {name!r}")
