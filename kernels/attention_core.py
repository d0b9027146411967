"""`AttentionCore`, the parameter-free module a transformer block's attention calls over `(B, S, heads, head_dim)`
q/k/v: dense, or VSA-H3 while the model's `SparseSwitch` holds a plan. Sequence parallelism replaces it with a
subclass that exchanges heads for rows around the same call (`h3gen.parallel.ulysses.UlyssesAttention`)."""

import torch
import torch.nn as nn

from h3gen.kernels.vsa_h3 import SparseSwitch, attend


class AttentionCore(nn.Module):
    """Attention under `backend` (None: the dispatch's choice) and the model's `SparseSwitch` (`sparse`, shared by
    the cores of one model; None in the text refiner)."""

    def __init__(self, backend: str | None = None, sparse: SparseSwitch | None = None):
        super().__init__()
        self.backend = backend
        self.sparse = sparse

    @property
    def plan(self):
        """The running forward's `SparsePlan`, or None (dense)."""
        return self.sparse.plan if self.sparse is not None else None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return attend(query, key, value, gate, self.plan, backend=self.backend)
