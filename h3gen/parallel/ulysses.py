"""Ulysses sequence parallelism for attention: each rank holds a contiguous slice of the (padded) packed sequence;
around attention one all-to-all trades rows for heads (q, k and v packed into a single exchange), attention runs
over the whole sequence for 1/sp of the heads, and a second all-to-all trades them back."""

import torch
import torch.distributed as dist
import torch.nn as nn

from h3gen.kernels.attention import attention
from h3gen.parallel.state import ParallelState


class SequenceShard:
    """The current forward's sequence geometry, shared by the hooks and the attention cores of one model."""

    def __init__(self, sp: int):
        self.sp = sp
        self.valid = 0  # real rows; the padded length is a multiple of sp and the pad rows are trailing
        self.padded = 0

    @property
    def local(self) -> int:
        return self.padded // self.sp


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal chunks of dim 0 (chunk j goes to rank j); both buffers contiguous in logical order."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class UlyssesAttention(nn.Module):
    """Drop-in for `AttentionCore` under SP: q, k, v `(B, S_local, H, D)` -> `(B, S_local, H, D)`."""

    def __init__(self, state: ParallelState, shard: SequenceShard, backend: str | None = None):
        super().__init__()
        self.state, self.shard, self.backend = state, shard, backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        sp, group = self.state.sp, self.state.sp_group
        batch, rows, heads, dim = query.shape
        if heads % sp:
            raise ValueError(f"{heads} local heads do not divide over {sp} sequence-parallel ranks.")
        # (3, B, S_l, sp, H/sp, D) -> destination-major (sp, 3, B, S_l, H/sp, D): one exchange for q, k and v.
        packed = torch.stack([query, key, value]).view(3, batch, rows, sp, heads // sp, dim).permute(3, 0, 1, 2, 4, 5)
        received = _all_to_all(packed, group)  # (source rank = row block, 3, B, S_l, H/sp, D)
        q, k, v = received.permute(1, 2, 0, 3, 4, 5).reshape(3, batch, sp * rows, heads // sp, dim)
        valid = self.shard.valid  # pad rows are trailing: no query attends to them
        out = (
            attention(q, k[:, :valid], v[:, :valid], backend=self.backend)
            if valid < sp * rows
            else attention(q, k, v, backend=self.backend)
        )
        # (B, sp * S_l, H/sp, D) -> (sp, B, S_l, H/sp, D) -> exchange back -> (B, S_l, H, D).
        out = _all_to_all(out.view(batch, sp, rows, heads // sp, dim).permute(1, 0, 2, 3, 4), group)
        return out.permute(1, 2, 0, 3, 4).reshape(batch, rows, heads, dim)
