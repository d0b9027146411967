"""Test helpers: an H3 transformer for one rank of a TP x SP grid, and filling it from full-size weights (the
production path loads each rank's shard from the checkpoint files instead, `H3Transformer.from_pretrained`)."""

import datetime

import torch
import torch.distributed as dist

from h3gen.linear import make_linear_factory
from h3gen.parallel.sequence import enable_sequence_parallel
from h3gen.parallel.state import ParallelState
from h3gen.pipelines.h3.transformer import H3Transformer


def parallel_transformer(config, state: ParallelState):
    """An `H3Transformer` whose block linears are this rank's TP shards and whose blocks run this rank's slice of
    the sequence (Ulysses). Same state-dict keys as the full model."""
    model = H3Transformer(config, linear_factory=make_linear_factory(parallel=state))
    if state.sp > 1:
        enable_sequence_parallel(model, state)
    model.parallel_state = state
    return model


def load_full_state_dict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full-size tensors into `model`, cutting each to this rank's shard (`load_shard` of its module)."""
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            full = state_dict[name]
            tensor = module.load_shard(leaf, full) if hasattr(module, "load_shard") else full
            param.copy_(tensor)


def join_gloo(rank: int, world: int, init_file) -> None:
    """Put this test process in a gloo group of `world` processes met through `init_file`, one CPU thread each (the
    ranks share the machine's cores)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
