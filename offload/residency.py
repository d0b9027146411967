"""Which transformer blocks stay on the GPU and which stream from host memory, for a given GPU memory budget."""

from dataclasses import dataclass

from h3gen.errors import RequestError
from h3gen.options import GiB, parse_bytes  # noqa: F401  (parse_bytes: part of this module's API)


@dataclass(frozen=True)
class OffloadPlan:
    """`resident` blocks live on the GPU; `streamed` ones are copied in through a ring of `slots` GPU buffers."""

    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    slots: int
    gpu_bytes: int  # block weights on the GPU at the peak: resident blocks + the ring


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def spread(count: int, total: int) -> list[int]:
    """`count` indices spread evenly over range(total) (the resident blocks of the strided policy)."""
    if count <= 0:
        return []
    if count >= total:
        return list(range(total))
    return sorted({round(i * total / count) for i in range(count)})


def plan_residency(
    block_bytes: list[int], budget_bytes: int, *, prefetch: int = 2, policy: str = "strided"
) -> OffloadPlan:
    """Keep as many blocks resident as fit in `budget_bytes` next to a ring of `prefetch + 1` streaming buffers.

    Args:
        block_bytes: streamed bytes of each block, in forward order.
        budget_bytes: GPU memory the blocks may use (the caller has subtracted activations and the rest).
        prefetch: blocks copied ahead of the one computing.
        policy: "strided" spreads the resident blocks over the stack (the stream's load is even over a step);
            "leading" keeps the first ones.
    Raises:
        RequestError when not even the ring fits, naming the smallest budget that would.
    """
    if prefetch < 1:
        raise RequestError(f"prefetch must be at least 1 (got {prefetch}).", "prefetch")
    if policy not in ("strided", "leading"):
        raise RequestError(f"offload policy must be strided or leading (got {policy!r}).", "policy")
    total = sum(block_bytes)
    if total <= budget_bytes:
        return OffloadPlan(tuple(range(len(block_bytes))), (), 0, total)
    slots = min(prefetch + 1, len(block_bytes))
    ring = slots * max(block_bytes)
    if ring > budget_bytes:
        raise RequestError(
            f"gpu_memory leaves {format_bytes(budget_bytes)} for transformer blocks, but streaming with prefetch "
            f"{prefetch} needs {format_bytes(ring)} of buffers; give at least {format_bytes(ring - budget_bytes)} "
            "more or lower --prefetch.",
            "gpu_memory",
        )
    # Most resident blocks that fit next to the ring (blocks are near-equal in size; check the actual choice).
    for count in range(len(block_bytes) - 1, -1, -1):
        chosen = spread(count, len(block_bytes)) if policy == "strided" else list(range(count))
        if sum(block_bytes[i] for i in chosen) + ring <= budget_bytes:
            break
    streamed = tuple(i for i in range(len(block_bytes)) if i not in chosen)
    slots = min(slots, len(streamed))
    return OffloadPlan(tuple(chosen), streamed, slots, sum(block_bytes[i] for i in chosen) + slots * max(block_bytes))
