"""Reference implementations the K3 tests compare against: fla-core's naive KDA functions and transformers'
Kimi-Linear model on its plain-torch path.

With fla-core installed, transformers' Kimi-Linear binds fla's Triton kernels at import time, which cannot run on
a CPU; `kimi_linear_torch()` therefore imports the modeling module afresh with `fla` hidden, so it takes its own
torch functions.
"""

import importlib
import sys

import torch

_MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"


def kimi_linear_torch():
    """transformers' `modeling_kimi_linear` module bound to its torch fallbacks (a private copy)."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == _MODELING}
    hidden = {name: sys.modules[name] for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    for name in hidden:
        sys.modules[name] = None
    sys.modules["fla"] = None
    try:
        module = importlib.import_module(_MODELING)
    finally:
        sys.modules.pop("fla", None)
        for name in hidden:
            sys.modules[name] = hidden[name]
        sys.modules.pop(_MODELING, None)
        sys.modules.update(saved)
    return module


def fla_naive():
    """fla-core's `fla.ops.kda.naive` (plain torch, imports on a CPU)."""
    return importlib.import_module("fla.ops.kda.naive")


def fla_gate():
    return importlib.import_module("fla.ops.kda.gate")


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (a relative error on the scale of the tensor)."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()
