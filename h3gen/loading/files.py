"""Finding the safetensors files of one component folder (a single file or a sharded index)."""

import json
from pathlib import Path

from h3gen.errors import CheckpointError

# Index and file names diffusers and transformers write, most specific first.
_INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
_SINGLE_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def read_json(path: Path) -> dict:
    """Parse a JSON file, turning a missing or malformed file into a `CheckpointError` naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}.") from None


def safetensors_files(folder: Path) -> dict[Path, list[str] | None]:
    """The weight files of a component folder, each with the keys the index assigns to it (None = read all).

    Looks for a sharded index first, then a single known file name, then any `*.safetensors` file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint folder {folder} does not exist.")
    for name in _INDEX_NAMES:
        index_path = folder / name
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has no weight_map.")
            files: dict[Path, list[str]] = {}
            for key, file_name in weight_map.items():
                files.setdefault(folder / file_name, []).append(key)
            missing = [str(p.name) for p in files if not p.exists()]
            if missing:
                raise CheckpointError(f"{index_path} lists shard files that are missing: {', '.join(missing)}.")
            return files
    for name in _SINGLE_NAMES:
        if (folder / name).exists():
            return {folder / name: None}
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"No safetensors weights in {folder} (expected {_SINGLE_NAMES[0]} or an index).")
    return {path: None for path in found}
