"""Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while the kernel before it
is finishing, so a chain of small kernels (a decode step) loses less time at each boundary.

A kernel written for it takes `PDL: tl.constexpr` and calls `wait_for_inputs(PDL)` before reading anything an
earlier kernel of the stream wrote and before writing anything; above that call it may only read what no kernel
of the step writes (weights), which then loads while the previous kernel drains. Because every such kernel waits
before it lets its own dependents start, a kernel may also read, before its wait, what the kernel two back wrote:
that one has finished by then. Launch with `**pdl_launch(tensor)`."""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_CAPABLE: dict[int, bool] = {}


def pdl_launch(tensor: torch.Tensor) -> dict:
    """Launch options for a kernel over `tensor`'s device: `{"launch_pdl": True}` on a CUDA GPU of compute
    capability 9.0 or newer, `{}` elsewhere (the CPU, the Triton interpreter) or with `H3GEN_PDL=0`."""
    if not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("H3GEN_PDL") == "0":
        return {}
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"launch_pdl": True} if _CAPABLE[index] else {}


def pdl_flag(options: dict) -> bool:
    """The kernel's `PDL` constexpr for launch `options` from `pdl_launch`."""
    return bool(options.get("launch_pdl"))


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next kernel start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
