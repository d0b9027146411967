"""Process groups for TP x SP: ranks `sp_rank * tp + tp_rank`, so the TP group of a rank is `tp` consecutive ranks
(one host's fast links first) and its SP group strides across them."""

from dataclasses import dataclass

import torch.distributed as dist

from h3gen.errors import RequestError


@dataclass
class ParallelState:
    """This rank's place in the TP x SP grid and its two groups (None when the degree is 1)."""

    tp: int
    sp: int
    tp_rank: int
    sp_rank: int
    tp_group: object = None
    sp_group: object = None

    @property
    def world(self) -> int:
        return self.tp * self.sp


def valid_degrees(heads: int, world: int) -> list[tuple[int, int]]:
    """Every (tp, sp) with tp * sp = world, heads % tp == 0 and (heads / tp) % sp == 0."""
    return [
        (tp, world // tp)
        for tp in range(1, world + 1)
        if world % tp == 0 and heads % tp == 0 and (heads // tp) % (world // tp) == 0
    ]


def check_degrees(heads: int, tp: int, sp: int, world: int | None = None) -> None:
    """Refuse degrees the model cannot be split by, listing the valid ones."""
    world = world if world is not None else tp * sp
    valid = valid_degrees(heads, world)
    if tp < 1 or sp < 1 or (tp, sp) not in valid:
        listed = ", ".join(f"--tp {t} --ulysses {s}" for t, s in valid) or (
            "none for this process count; use one that divides the heads: "
            + ", ".join(str(n) for n in range(1, 65) if heads % n == 0)
        )
        raise RequestError(
            f"cannot run {heads} attention heads with --tp {tp} --ulysses {sp} on {world} processes: the heads must "
            f"divide by tp and the heads per TP rank by ulysses, and tp x ulysses must equal the process count. "
            f"Valid here: {listed}.",
            "parallel",
        )


def init_parallel(tp: int, sp: int, heads: int) -> ParallelState:
    """Build the groups from the initialised default process group (world = tp * sp)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_degrees(heads, tp, sp, world)
    tp_rank, sp_rank = rank % tp, rank // tp
    state = ParallelState(tp=tp, sp=sp, tp_rank=tp_rank, sp_rank=sp_rank)
    # Every rank must create every group, in the same order.
    for s in range(sp):
        group = dist.new_group([s * tp + t for t in range(tp)])
        if s == sp_rank:
            state.tp_group = group
    for t in range(tp):
        group = dist.new_group([s * tp + t for s in range(sp)])
        if t == tp_rank:
            state.sp_group = group
    return state
