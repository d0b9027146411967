"""A MiniMax-H3 checkpoint folder in diffusers' layout: its index, its component folders, its canvas configs.

`modular_model_index.json` (or `model_index.json`) names the components; each lives in `<folder>/<subfolder>/`.
Only local folders are read: an index entry that points at a hub repository still resolves to the local subfolder.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3gen.errors import CheckpointError
from h3gen.loading.files import read_json
from h3gen.offload import host_memory
from h3gen.pipelines.h3.geometry import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE

logger = logging.getLogger(__name__)

INDEX_NAMES = ("modular_model_index.json", "model_index.json")
# Workflow "auto" loads every task only while both partitions together take at most this share of the memory they
# would load into: the tiny demo serves ref2va out of the box, the released model (2 x 62 GB) loads one partition.
AUTO_ALL_SHARE = 0.25
# What each workflow needs; the first missing one is reported by name.
REQUIRED = {
    "t2va": ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler"),
    "fl2va": (
        "transformer",
        "vae",
        "audio_vae",
        "text_encoder",
        "tokenizer",
        "processor",
        "scheduler",
        "audio_scheduler",
    ),
    # ref2va runs on its own partition of the transformer weights (diffusers 0.42.1
    # modular_pipelines/minimax_h3/denoise.py:136-140, `MiniMaxH3Ref2VALoopDenoiser`).
    "ref2va": (
        "transformer_ref",
        "vae",
        "audio_vae",
        "text_encoder",
        "tokenizer",
        "processor",
        "scheduler",
        "audio_scheduler",
    ),
}
# Which transformer partition serves each task.
TRANSFORMER_OF = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}


@dataclass
class H3Checkpoint:
    """Resolved checkpoint folder: component name -> local folder, plus the pipeline-level configs."""

    root: Path
    components: dict[str, Path] = field(default_factory=dict)
    canvas_short_edge: int = CANVAS_SHORT_EDGE
    canvas_max_pixels: int = CANVAS_MAX_PIXELS
    reference_image_short_edge: int = 2048  # ref2va image references are encoded at this short edge

    @classmethod
    def open(cls, root) -> "H3Checkpoint":
        """Read the index of `root` (a local folder). Components without an index entry fall back to
        `<root>/<name>/` when that folder exists."""
        root = Path(root).expanduser()
        if not root.is_dir():
            raise CheckpointError(f"Model folder {root} does not exist (h3gen reads local folders only).")
        index_path = next((root / name for name in INDEX_NAMES if (root / name).exists()), None)
        index = read_json(index_path) if index_path else {}
        checkpoint = cls(root=root)
        checkpoint.canvas_short_edge = int(index.get("canvas_short_edge", CANVAS_SHORT_EDGE))
        checkpoint.canvas_max_pixels = int(index.get("canvas_max_pixels", CANVAS_MAX_PIXELS))
        checkpoint.reference_image_short_edge = int(index.get("reference_image_short_edge", 2048))
        names = {name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)}
        names |= {p.name for p in root.iterdir() if p.is_dir()}
        for name in sorted(names):
            entry = index.get(name)
            subfolder = name
            if isinstance(entry, list) and len(entry) >= 3 and isinstance(entry[2], dict):
                subfolder = entry[2].get("subfolder") or name
            if (root / subfolder).is_dir():
                checkpoint.components[name] = root / subfolder
        return checkpoint

    def folder(self, name: str, purpose: str = "") -> Path:
        """The local folder of component `name`, or a `CheckpointError` saying it is missing and what needs it."""
        if name not in self.components:
            need = f" (needed for {purpose})" if purpose else ""
            raise CheckpointError(f"{self.root} has no {name}/ component folder{need}.")
        return self.components[name]

    def require(self, workflow: str) -> None:
        """Check every component `workflow` needs is present ("all": every task's)."""
        if workflow == "all":
            for task in REQUIRED:
                self.require(task)
            return
        if workflow not in REQUIRED:
            raise CheckpointError(f"workflow must be one of {', '.join(REQUIRED)} or all (got {workflow!r}).")
        for name in REQUIRED[workflow]:
            self.folder(name, workflow)

    def tasks(self) -> tuple[str, ...]:
        """The tasks whose components are all present, in the order t2va, fl2va, ref2va."""
        return tuple(task for task, names in REQUIRED.items() if all(name in self.components for name in names))


def resolve_workflow(checkpoint: H3Checkpoint, workflow: str, device) -> str:
    """`workflow` itself, or for "auto": "all" when the checkpoint holds one transformer partition or both are small
    next to `device`'s memory (host memory on the CPU), else "fl2va" (t2va + fl2va on `transformer/`; "t2va"
    without `processor/`), logged, since ref2va would hold a second 62 GB partition."""
    if workflow != "auto":
        return workflow
    available = checkpoint.tasks()
    if "ref2va" not in available or len(available) == 1:
        return "all"
    device = torch.device(device)
    partitions = sum(host_memory.folder_bytes(checkpoint.folder(name)) for name in ("transformer", "transformer_ref"))
    if device.type == "cuda" and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = host_memory.available_host_bytes() or 0
    if partitions <= AUTO_ALL_SHARE * memory:
        return "all"
    logger.info(
        "serving t2va and fl2va only: ref2va needs the transformer_ref/ partition as well (%.0f GB for "
        "both); start with --workflow all (or ref2va) to serve it.",
        partitions / 1e9,
    )
    return "fl2va" if "fl2va" in available else "t2va"
