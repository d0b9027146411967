"""How a pipeline asks PyTorch's CUDA allocator to manage device memory.

A resident MiniMax-H3 pipeline fills an H200 to within a few GiB (the transformer, the text encoder and a 15 s
request's activations), and requests of different sizes (a clip's windows, the VAE's chunks) free and allocate
blocks of many sizes. With the allocator's default fixed-size segments the freed space splinters: on an H200 a 30 s
clip's first window ran out of memory with 8.6 GiB reserved but unallocated. Expandable
segments (one segment per stream that grows and shrinks by pages) leave no such splinters; PyTorch's documentation
recommends them for workloads whose allocation sizes change between iterations.

The operator's own `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` is left as it is.

`torch.cuda.mem_get_info` counts the blocks the caching allocator holds but no tensor uses (reserved less allocated)
as used, although our next allocations are served from them: after one large request almost all the device looks
taken. `available_device_memory` counts them as available.
"""

import logging
import os

import torch

logger = logging.getLogger(__name__)

ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def use_expandable_segments(device) -> bool:
    """On a CUDA `device`, switch the caching allocator to expandable segments for every allocation from now on,
    unless the environment configures the allocator. Returns whether the setting was applied."""
    if torch.device(device).type != "cuda":
        return False
    if any(os.environ.get(name) for name in ALLOC_CONF_VARIABLES):
        return False
    try:
        _set_allocator_settings("expandable_segments:True")
    except RuntimeError as error:  # a build or driver without the virtual memory API keeps the default
        logger.warning("expandable segments are not available (%s); the CUDA allocator keeps its default.", error)
        return False
    return True


def available_device_memory(device) -> int | None:
    """Bytes our tensors may still take on `device`: the driver's free memory plus the blocks PyTorch's allocator
    caches there unused; None off CUDA (no figure to cap by)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
