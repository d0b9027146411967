"""Putting an `H3Transformer` on a GPU budget: everything but the blocks moves to the GPU; the planner decides
which blocks stay and which stream."""

import torch

from h3gen.offload.layerwise import LayerwiseOffload, owned_tensors
from h3gen.offload.residency import OffloadPlan, plan_residency
from h3gen.options import parse_bytes

ON_DEMAND = ("adaln_proj",)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def apply_layerwise_offload(
    transformer,
    device,
    *,
    gpu_memory,
    prefetch: int = 2,
    activation_reserve=None,
    policy: str = "strided",
    copy_log=None,
    host_store=None,
) -> LayerwiseOffload:
    """Offload `transformer`'s blocks (loaded on the CPU) to fit `gpu_memory` on `device`.

    `gpu_memory` ("30GiB", bytes) is what the transformer may use on the GPU, activations included; the
    non-block weights and `activation_reserve` (default a fifth of it) come off the top, the blocks share the rest.
    Each block's AdaLN projection is left out of the per-step stream (its tables are computed once per request).
    `host_store` (a `SharedHostStore`) puts the blocks in one host copy shared by the machine's ranks; on a reader
    rank the blocks may be left unloaded (meta).
    """
    budget = parse_bytes(gpu_memory)
    reserve = parse_bytes(activation_reserve) if activation_reserve is not None else budget // 5
    blocks = transformer.transformer_blocks
    for module in transformer.children():
        if module is not blocks:
            module.to(device)
    block_bytes = [_bytes(t for *_, t in owned_tensors(block, ON_DEMAND)) for block in blocks]
    other = _bytes(p for n, p in transformer.named_parameters() if not n.startswith("transformer_blocks."))
    plan = plan_residency(block_bytes, budget - other - reserve, prefetch=prefetch, policy=policy)
    offload = LayerwiseOffload(
        blocks, plan, device, prefetch=prefetch, on_demand=ON_DEMAND, copy_log=copy_log, host_store=host_store
    )
    transformer.offload = offload
    transformer.offload_plan = plan
    if torch.device(device).type == "cuda":  # what a request's activations may take on the GPU (checked per request)
        transformer.activation_budget_bytes = reserve
    return offload


def stream_layers(layers, device, *, prefetch: int = 2, copy_log=None) -> LayerwiseOffload:
    """Stream every module of `layers` (e.g. the text encoder's decoder layers) from pinned host memory through a
    ring of `prefetch + 1` GPU buffers; the modules around them are the caller's to place."""
    count = len(layers)
    slots = min(prefetch + 1, count)
    plan = OffloadPlan(resident=(), streamed=tuple(range(count)), slots=slots, gpu_bytes=0)
    return LayerwiseOffload(layers, plan, device, prefetch=prefetch, on_demand=(), copy_log=copy_log)
