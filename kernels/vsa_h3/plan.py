"""What the attention cores of one transformer need to run VSA-H3: the running forward's `SparsePlan` (the request's
tile geometry and this forward's sparsity), held by one `SparseSwitch` that the model's cores share (`attend` in the
package runs one call under it)."""

from dataclasses import dataclass

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
