"""Sequence parallelism wired in at the model's module boundaries (as diffusers' context-parallel plan does), so the
transformer file stays the plain single-device model:

- before `rope`: the packed length is padded to a multiple of sp and this rank keeps its contiguous slice of the
  positions, so it computes rotary angles for its own rows only;
- before each block: block 0 cuts the residual stream the same way; every block cuts its copy of the AdaLN
  indices, so modulation is gathered for this rank's rows only;
- before `norm_out`: the same cut of `timestep_indices`;
- after `proj_out` / `audio_proj_out`: the head outputs of all ranks are gathered and the pad rows dropped, so the
  model's own `index_select` of video and audio rows works on the full sequence;
- every block's attention core becomes `UlyssesAttention` (pad rows never serve as keys).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from h3gen.parallel.state import ParallelState
from h3gen.parallel.ulysses import SequenceShard, UlyssesAttention


def _pad_rows(t: torch.Tensor, padded: int, dim: int) -> torch.Tensor:
    missing = padded - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, missing]
    return F.pad(t, pad)


def enable_sequence_parallel(model, state: ParallelState) -> SequenceShard:
    """Split `model` (an `H3Transformer`) over `state.sp` ranks along the packed sequence."""
    shard = SequenceShard(state.sp)

    def local(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _pad_rows(t, shard.padded, dim).narrow(dim, state.sp_rank * shard.local, shard.local)

    first = model.transformer_blocks[0] if len(model.transformer_blocks) else None

    def before_rope(module, args, kwargs):
        # The first thing the forward computes per row: fix this forward's geometry, keep this rank's positions.
        (position_ids,) = args
        shard.valid = position_ids.shape[0]
        shard.padded = -(-shard.valid // state.sp) * state.sp
        return (local(position_ids, 0),), kwargs

    def before_block(module, args, kwargs):
        hidden, temb, indices, rotary_emb, *rest = args  # rotary_emb is already this rank's rows
        if module is first:
            hidden = local(hidden, 1)
        return (hidden, temb, local(indices, 0), rotary_emb, *rest), kwargs

    def before_norm_out(module, args, kwargs):
        x, temb, timestep_indices, *rest = args
        if first is None:  # no blocks: the stream was never cut, so cut it here
            x = local(x, 1)
        return (x, temb, local(timestep_indices, 0), *rest), kwargs

    def gather_rows(module, args, output):
        parts = [torch.empty_like(output) for _ in range(state.sp)]
        dist.all_gather(parts, output.contiguous(), group=state.sp_group)
        return torch.cat(parts, dim=1)[:, : shard.valid]

    model.rope.register_forward_pre_hook(before_rope, with_kwargs=True)
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(before_block, with_kwargs=True)
        core = block.attn.core
        block.attn.core = UlyssesAttention(state, shard, backend=core.backend, sparse=core.sparse)
    model.sequence_shard = shard  # this forward's geometry, for whoever reads this rank's rows (the step cache)
    model.norm_out.register_forward_pre_hook(before_norm_out, with_kwargs=True)
    model.proj_out.register_forward_hook(gather_rows)
    model.audio_proj_out.register_forward_hook(gather_rows)
    return shard
