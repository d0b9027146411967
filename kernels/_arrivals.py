"""Arrival counters for kernels that finish with a step needing every program's part (a norm over a whole head, a
top-k over all experts' logits): each program stores its part, counts itself in with an atomic add, and the one
that arrives last does the step and sets its counter back to zero, so the buffer is all zeros between launches and
a captured CUDA graph can replay the kernel as it is.

One buffer per device and kernel family, allocated once and never shrunk (a graph keeps using the buffer it was
captured with). Launches of one family must not overlap in time: h3gen runs them on one stream. Run a kernel once
before capturing it in a CUDA graph: a buffer first allocated during a capture is zero-filled by every replay."""

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, family: str, needed: int) -> torch.Tensor:
    """An int32 buffer of at least `needed` zeros on `device` for the kernels of `family` (the same tensor each call
    while it is large enough)."""
    key = (torch.device(device), family)
    counts = _BUFFERS.get(key)
    if counts is None or counts.numel() < needed:
        counts = torch.zeros(max(needed, 8192), dtype=torch.int32, device=device)
        _BUFFERS[key] = counts
    return counts
