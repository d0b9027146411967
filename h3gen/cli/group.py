"""`h3gen serve` and `h3gen worker` as one torchrun group for `--tp` / `--ulysses`: the degrees checked against the
model before anything starts, the command relaunched under torchrun, each rank joining the group, and the ranks
other than 0 following rank 0's jobs. torch and the model code are imported inside the functions, so that importing
the CLI stays free of them."""

import argparse
import signal
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GroupRank:
    """What is left to this process once `start_serving_group` returns: the `exit_code` to return (the relaunched
    group ended, or this rank followed rank 0 until the group stopped), or None for rank 0, which serves with
    `parallel` (a `ParallelState`) on `device`."""

    exit_code: int | None = None
    parallel: object | None = None
    device: str | None = None


def model_heads(model: str) -> int:
    """The attention heads of the transformer in checkpoint folder `model` (read from its config)."""
    from h3gen.pipelines.h3 import read_transformer_config
    from h3gen.pipelines.h3.checkpoint import H3Checkpoint

    return read_transformer_config(H3Checkpoint.open(model)).num_attention_heads


def check_group_degrees(args: argparse.Namespace) -> None:
    """Refuse (`RequestError`) `--tp` and `--ulysses` degrees that `args.model`'s heads cannot be split by."""
    from h3gen.parallel.state import check_degrees

    check_degrees(model_heads(args.model), args.tp, args.ulysses)


def start_serving_group(
    args: argparse.Namespace,
    relaunch: Callable[[], int],
    serving: dict,
    dtype,
    *,
    followers_ignore_signals: bool = False,
) -> GroupRank:
    """Run this command as a group of `--tp` x `--ulysses` ranks. Outside torchrun: check the degrees, then
    `relaunch()` the command under torchrun and return its exit code. Under torchrun: join the group; a rank other
    than 0 loads the model as `serving` and `dtype` say and follows rank 0's jobs until the group stops (ignoring
    SIGTERM and SIGINT with `followers_ignore_signals`, where rank 0 decides when the group stops)."""
    import torch

    from h3gen.parallel.launch import launched_by_torchrun, start_rank

    if not launched_by_torchrun():
        check_group_degrees(args)
        return GroupRank(exit_code=relaunch())
    parallel, device = start_rank(args.tp, args.ulysses, model_heads(args.model), args.device)
    if torch.distributed.get_rank() == 0:
        return GroupRank(parallel=parallel, device=device)
    from h3gen.server.distributed import follow

    if followers_ignore_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
    follow(args.model, parallel=parallel, device=device, dtype=dtype, **serving)
    return GroupRank(exit_code=0)
