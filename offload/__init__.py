"""Layer-wise host offload (`h3gen.offload`). The unit is one transformer block (`H3TransformerBlock`): a residency
planner keeps as many blocks on the GPU as the budget allows and streams the rest from pinned host memory."""

from h3gen.offload.apply import OFFLOAD_MODES, apply_layerwise_offload, stream_layers
from h3gen.offload.layerwise import LayerwiseOffload
from h3gen.offload.planner import OffloadPlan, plan_residency
from h3gen.offload.shared_host import SharedHostStore

__all__ = ["OFFLOAD_MODES", "LayerwiseOffload", "OffloadPlan", "SharedHostStore", "apply_layerwise_offload",
           "plan_residency", "stream_layers"]
