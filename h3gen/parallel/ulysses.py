"""Ulysses sequence parallelism for attention: each rank holds a contiguous slice of the (padded) packed sequence;
around attention one all-to-all trades rows for heads (q, k and v packed into a single exchange, with a VSA
student's compression gate as a fourth tensor), attention runs over the whole sequence for 1/sp of the heads (dense,
or VSA-H3 over the unpadded rows), and a second all-to-all trades them back."""

import torch
import torch.distributed as dist

from h3gen.kernels.attention_core import AttentionCore
from h3gen.kernels.vsa_h3 import SparseSwitch, attend
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


class UlyssesAttention(AttentionCore):
    """`AttentionCore` under SP: q, k, v (and a gate) `(B, S_local, H, D)` -> `(B, S_local, H, D)`."""

    def __init__(
        self, state: ParallelState, shard: SequenceShard, backend: str | None = None, sparse: SparseSwitch | None = None
    ):
        super().__init__(backend, sparse)
        self.state, self.shard = state, shard

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        sp, group = self.state.sp, self.state.sp_group
        batch, rows, heads, dim = query.shape
        if heads % sp:
            raise ValueError(f"{heads} local heads do not divide over {sp} sequence-parallel ranks.")
        tensors = [query, key, value] if gate is None else [query, key, value, gate]
        count = len(tensors)
        # (n, B, S_l, sp, H/sp, D) -> destination-major (sp, n, B, S_l, H/sp, D): one exchange for all of them.
        packed = torch.stack(tensors).view(count, batch, rows, sp, heads // sp, dim).permute(3, 0, 1, 2, 4, 5)
        received = _all_to_all(packed, group)  # (source rank = row block, n, B, S_l, H/sp, D)
        q, k, v, *g = received.permute(1, 2, 0, 3, 4, 5).reshape(count, batch, sp * rows, heads // sp, dim)
        valid = self.shard.valid  # pad rows are trailing: no query attends to them
        plan = self.plan
        if plan is not None:  # the tile geometry covers the real rows only; pad rows' outputs are dropped later
            out = attend(q[:, :valid], k[:, :valid], v[:, :valid], g[0][:, :valid] if g else None, plan, self.backend)
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, sp * rows - valid)) if valid < sp * rows else out
        elif valid < sp * rows:
            out = attend(q, k[:, :valid], v[:, :valid], g[0] if g else None, None, self.backend)
        else:
            out = attend(q, k, v, g[0] if g else None, None, self.backend)
        # (B, sp * S_l, H/sp, D) -> (sp, B, S_l, H/sp, D) -> exchange back -> (B, S_l, H, D).
        out = _all_to_all(out.view(batch, sp, rows, heads // sp, dim).permute(1, 0, 2, 3, 4), group)
        return out.permute(1, 2, 0, 3, 4).reshape(batch, rows, heads, dim)
