"""Layer-wise host offload (`h3gen.offload`). The unit is one transformer block (`H3TransformerBlock`): a residency
planner keeps as many blocks on the GPU as the budget allows and streams the rest from pinned host memory.
`plan_placement` decides where a pipeline's parts load under a run's offload mode ("none", "stage", "layerwise")."""

if __name__ == "offload":  # a bare import from the checkout root: the installed `offload` stands in
    from h3gen.checkout_names import defer_to_installed

    defer_to_installed(__name__, __file__)
else:
    from h3gen.offload.apply import apply_layerwise_offload, stream_layers
    from h3gen.offload.layerwise import LayerwiseOffload
    from h3gen.offload.placement import Placement, plan_placement
    from h3gen.offload.residency import OffloadPlan, plan_residency
    from h3gen.offload.shared_host import SharedHostStore
    from h3gen.options import OFFLOAD_MODES

    __all__ = [
        "OFFLOAD_MODES",
        "LayerwiseOffload",
        "OffloadPlan",
        "Placement",
        "SharedHostStore",
        "apply_layerwise_offload",
        "plan_placement",
        "plan_residency",
        "stream_layers",
    ]
