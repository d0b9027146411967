"""What the attention cores of one transformer need to run VSA-H3: the running forward's `SparsePlan` (the request's
tile geometry and this forward's sparsity), held by one `SparseSwitch` that the model's cores share, and `attend`,
the one call a core makes whatever the plan."""

from dataclasses import dataclass

import torch

from h3gen.kernels.attention import attention
from h3gen.kernels.vsa_h3.geometry import TileGeometry


@dataclass(frozen=True)
class SparsePlan:
    """One forward's sparse attention: `geometry` (built once per request shape, on the model's device) and the
    fraction of video key tiles dropped, in [0, 1)."""

    geometry: TileGeometry
    sparsity: float


class SparseSwitch:
    """The running forward's `SparsePlan`, or None for dense attention; set by the denoising loop before each forward
    and read by every block's attention core."""

    def __init__(self):
        self.plan: SparsePlan | None = None


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor | None,
    plan: SparsePlan | None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of one packed sequence: dense (`attention`) without a plan, else VSA-H3 with this forward's sparsity
    and, for a VSA student, its compression gate.

    Args:
        query, key, value: `(B, S, H, D)` post-RoPE heads.
        gate: `(B, S, H, D)` the block's `to_gate_compress` output, or None (a model without gates).
        plan: this forward's `SparsePlan`, or None.
        backend: the dense attention backend (`kernels.attention`), also for VSA-H3's dense parts.
    Returns:
        `(B, S, H, D)` in query's dtype.
    """
    if plan is None:
        if gate is not None:
            raise ValueError("a VSA student's gated attention needs a tile geometry (a SparsePlan); none was set.")
        return attention(query, key, value, backend=backend)
    from h3gen.kernels.vsa_h3 import vsa_h3_attention

    return vsa_h3_attention(query, key, value, plan.geometry, plan.sparsity, gate, dense_backend=backend)
