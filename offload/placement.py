"""Where a pipeline's parts load and how they reach the GPU under a run's offload mode.

- "none": every part loads onto the device and stays there.
- "stage": the text encoder and the VAEs load on the host and visit the device for their stage only (the pipeline
  moves them); the transformer loads onto the device.
- "layerwise": as "stage", and the transformer loads on the host: its non-block weights move to the device and its
  blocks stream from pinned host memory within `gpu_memory` (partitions loaded side by side share it), `prefetch`
  blocks ahead; the text encoder's decoder layers stream while it encodes. The host memory either mode takes (each
  component's files, or the size its loader gives where the copy differs from them: MXFP4 at load, a merged FastH3
  adapter's gates) is checked before anything loads. Under Ulysses without tensor parallelism the machine's ranks
  share one host copy of the blocks (in /dev/shm), which only local rank 0 loads.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.device_memory import use_expandable_segments
from h3gen.offload import host_memory
from h3gen.offload.apply import apply_layerwise_offload, stream_layers
from h3gen.offload.shared_host import SharedHostStore, shared_store_for_ranks
from h3gen.options import RunOptions

STAGE_PARTS = ("text_encoder", "vae", "audio_vae")  # what stage offload keeps on the host between its stages
BLOCK_PREFIX = "transformer_blocks."


@dataclass(frozen=True)
class Placement:
    """One pipeline's placement: where each part loads (`transformer_device`, `stage_device`) and the offload to
    put on it once loaded (`offload_transformer`, `offload_text_encoder`)."""

    options: RunOptions
    device: torch.device
    folders: dict[str, Path]  # component name -> folder (sizes the host copies)
    partitions: int = 1  # transformer partitions loaded side by side
    parallel: object | None = None  # an h3gen.parallel.ParallelState, or None
    loaded_bytes: dict[str, int] = field(default_factory=dict)  # component name -> its size once loaded, if known

    def host_bytes(self, name: str) -> int:
        """Bytes of component `name`'s host copy: its size once loaded where given, else its folder's weight files."""
        if name in self.loaded_bytes:
            return self.loaded_bytes[name]
        return host_memory.folder_bytes(self.folders[name])

    @property
    def layerwise(self) -> bool:
        return self.options.offload == "layerwise"

    @property
    def transformer_device(self) -> torch.device:
        """Where a transformer partition loads: the host under layer-wise offload, else the device."""
        return torch.device("cpu") if self.layerwise else self.device

    @property
    def stage_device(self) -> torch.device:
        """Where the text encoder and the VAEs wait between their stages."""
        return torch.device("cpu") if self.options.offload != "none" else self.device

    def host_store(self, name: str) -> SharedHostStore | None:
        """The machine-wide host copy of partition `name`'s blocks when Ulysses ranks can share one, else None."""
        if not self.layerwise or self.parallel is None or self.parallel.tp != 1:
            return None
        return shared_store_for_ranks(name, self.host_bytes(name), pin=self.device.type == "cuda")

    @staticmethod
    def skip_prefixes(store: SharedHostStore | None) -> tuple[str, ...]:
        """Weights a rank leaves unloaded: the blocks, on a rank that reads them from another rank's host copy."""
        return (BLOCK_PREFIX,) if store is not None and not store.owner else ()

    def offload_transformer(self, transformer, store: SharedHostStore | None = None) -> None:
        """Put a loaded `H3Transformer` on its share of the GPU budget (layer-wise offload only)."""
        if self.layerwise:
            share = self.options.gpu_memory_bytes // self.partitions
            apply_layerwise_offload(
                transformer, self.device, gpu_memory=share, prefetch=self.options.prefetch, host_store=store
            )

    def offload_text_encoder(self, layers) -> None:
        """Stream the text encoder's decoder `layers` (layer-wise offload only); the rest of it visits the device
        for its stage."""
        if self.layerwise:
            stream_layers(layers, self.device, prefetch=self.options.prefetch)


def plan_placement(
    options: RunOptions,
    device,
    folders: dict[str, Path],
    *,
    partitions: int = 1,
    parallel=None,
    loaded_bytes: dict[str, int] | None = None,
) -> Placement:
    """The `Placement` of a pipeline whose components live in `folders` (every part it will load: the transformer
    partitions, the text encoder, the VAEs); `loaded_bytes` gives the size of a component once loaded where it is not
    its files' (a transformer quantized to MXFP4 at load, or gaining a merged FastH3 adapter's gates). Raises
    `CheckpointError` before any loading when the host copies of stage or layer-wise offload would not fit in host
    memory. On a CUDA device the allocator takes expandable segments from here on (`h3gen.device_memory`), so the
    pipeline's requests of many sizes do not splinter the memory they share."""
    use_expandable_segments(device)
    placement = Placement(options, torch.device(device), dict(folders), partitions, parallel, dict(loaded_bytes or {}))
    if placement.layerwise:
        needed = sum(placement.host_bytes(name) for name in folders)
        host_memory.check_host_memory(
            needed, "layer-wise offload (host copies of the transformer, text encoder and VAEs)"
        )
    elif options.offload == "stage":
        needed = sum(placement.host_bytes(name) for name in folders if name in STAGE_PARTS)
        host_memory.check_host_memory(
            needed,
            "stage offload (host copies of the text encoder and VAEs)",
            advice="free memory, or use layer-wise offload, which streams the text encoder's layers",
        )
    return placement
