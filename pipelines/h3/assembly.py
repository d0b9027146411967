"""Putting an `H3Pipeline` together: where each part lives (`h3gen.offload.plan_placement`), each part built there
by a `PartBuilders` (from the checkpoint's files, or with random weights: `random_weights.py`), layer-wise offload
applied, the schedule shifts read. `H3Pipeline.from_pretrained` and `random_pipeline` both go through `assemble`."""

from dataclasses import dataclass
from typing import Callable

import torch

from h3gen.offload import plan_placement
from h3gen.options import RunOptions
from h3gen.pipelines.h3.checkpoint import H3Checkpoint
from h3gen.pipelines.h3.lora_registry import DEFAULT_MAX_CPU_LORAS
from h3gen.pipelines.h3.request import checkpoint_shifts


@dataclass
class PartBuilders:
    """How each part is made, given its `Placement`: `transformer(name, placement, store)` builds partition `name`
    ("transformer" or "transformer_ref"; `store` the host copy Ulysses ranks share, or None) on
    `placement.transformer_device`; `text_encoder(placement)` the `H3TextEncoder` and `vaes(placement)` the
    (video VAE, audio VAE) on `placement.stage_device`."""

    transformer: Callable
    text_encoder: Callable
    vaes: Callable


def assemble(
    pipeline_class,
    checkpoint: H3Checkpoint,
    options: RunOptions,
    device: torch.device,
    builders: PartBuilders,
    *,
    partitions: tuple[str, ...] = ("transformer",),
    parallel=None,
    planner=None,
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
    lora_gpu_memory=None,
    fasth3_adapter=None,
    loaded_bytes: dict[str, int] | None = None,
):
    """A `pipeline_class` (`H3Pipeline`) of `checkpoint`'s `partitions` and its text encoder and VAEs, placed as
    `options` say (under layer-wise offload the partitions share `gpu_memory`), split over `parallel`'s ranks when
    given; `fasth3_adapter` (merged into `transformer` by `builders`) gives the pipeline its contract, and
    `loaded_bytes` the size of a part once built where it is not its files' (`plan_placement`). Raises
    `CheckpointError` before building anything when layer-wise offload's host copies would not fit."""
    folders = {name: checkpoint.folder(name) for name in (*partitions, "text_encoder", "vae", "audio_vae")}
    placement = plan_placement(
        options, device, folders, partitions=len(partitions), parallel=parallel, loaded_bytes=loaded_bytes
    )
    models = {}
    for name in partitions:
        store = placement.host_store(name)
        models[name] = builders.transformer(name, placement, store)
        placement.offload_transformer(models[name], store)
    text_encoder = builders.text_encoder(placement)
    placement.offload_text_encoder(text_encoder.model.model.language_model.layers)
    vae, audio_vae = builders.vaes(placement)
    video_shift, audio_shift = checkpoint_shifts(checkpoint)
    return pipeline_class(
        models.get("transformer"),
        text_encoder,
        vae,
        audio_vae,
        checkpoint=checkpoint,
        device=device,
        video_shift=video_shift,
        audio_shift=audio_shift,
        transformer_ref=models.get("transformer_ref"),
        planner=planner,
        options=options,
        max_cpu_loras=max_cpu_loras,
        lora_gpu_memory=lora_gpu_memory,
        fasth3_adapter=fasth3_adapter,
    )
