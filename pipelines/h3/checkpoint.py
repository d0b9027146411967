"""A MiniMax-H3 checkpoint folder in diffusers' layout: its index, its component folders, its canvas configs.

`modular_model_index.json` (or `model_index.json`) names the components; each lives in `<folder>/<subfolder>/`.
Only local folders are read: an index entry that points at a hub repository still resolves to the local subfolder.
"""

from dataclasses import dataclass, field
from pathlib import Path

from h3gen.errors import CheckpointError
from h3gen.loading.files import read_json
from h3gen.pipelines.h3.geometry import CANVAS_MAX_PIXELS, CANVAS_SHORT_EDGE

INDEX_NAMES = ("modular_model_index.json", "model_index.json")
# What each workflow needs; the first missing one is reported by name.
REQUIRED = {
    "t2va": ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler"),
    "fl2va": ("transformer", "vae", "audio_vae", "text_encoder", "tokenizer", "processor", "scheduler",
              "audio_scheduler"),
    # ref2va runs on its own partition of the transformer weights (diffusers 0.42.1
    # modular_pipelines/minimax_h3/denoise.py:136-140, `MiniMaxH3Ref2VALoopDenoiser`).
    "ref2va": ("transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer", "processor", "scheduler",
               "audio_scheduler"),
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
