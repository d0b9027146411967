"""The server's LoRA folder (`h3gen serve --lora-dir DIR`): the only adapters a request may name.

A request names an adapter by its file name in the folder, with or without the `.safetensors` suffix. Names are
resolved inside the folder only: no path separators, no `..`, no hidden files, and a symbolic link whose target
lies outside the folder is refused. Messages name the name a client sent, never a server path.
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from h3gen.errors import RequestError
from h3gen.pipelines.h3 import LoraFile, read_lora, recipe_for

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
MAX_NAME_CHARS = 200
_NAME = re.compile(r"^[^/\\\x00-\x1f]+$")


@dataclass(frozen=True)
class LoraChoice:
    """One adapter of a request: its `name` in the folder, the file it resolved to, and its `scale`."""

    name: str
    path: Path
    scale: float


class LoraFolder:
    """The adapters in one folder. `head_dim` is the model's attention head size (for reading fused-QKV files)."""

    def __init__(self, folder, head_dim: int = 128):
        self.root = Path(folder).resolve()
        if not self.root.is_dir():
            raise RequestError(f"--lora-dir {folder} is not a folder.", "lora_dir")
        self.head_dim = head_dim
        self._described: dict[tuple, dict] = {}  # (name, size, mtime) -> listing entry

    def _inside(self, path: Path) -> bool:
        try:
            return path.resolve(strict=True).is_relative_to(self.root)
        except (OSError, RuntimeError):  # a dangling or looping link
            return False

    def names(self) -> list[str]:
        """The adapters' names (file stems), sorted: every `*.safetensors` regular file directly in the folder whose
        real location is inside it."""
        found = []
        for path in self.root.iterdir():
            if (
                path.name.endswith(SUFFIX)
                and not path.name.startswith(".")
                and self._inside(path)
                and path.resolve().is_file()
            ):
                found.append(path.name[: -len(SUFFIX)])
        return sorted(found)

    def path(self, name) -> Path:
        """The file of adapter `name`, or a `RequestError` (field "loras") naming it when the name is not a plain
        file name in the folder or no such adapter exists there."""
        if not isinstance(name, str) or not name.strip():
            raise RequestError(
                "each LoRA needs a name: the file name of an adapter in the server's LoRA folder "
                "(GET v1/loras lists them).",
                "loras",
            )
        shown = name[:MAX_NAME_CHARS]
        if len(name) > MAX_NAME_CHARS or not _NAME.match(name) or name.startswith(".") or ".." in name:
            raise RequestError(
                f"LoRA name {shown!r} is not an adapter name: give the file name of an adapter in the "
                "server's LoRA folder, without any folder part (GET v1/loras lists them).",
                "loras",
            )
        stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        path = self.root / f"{stem}{SUFFIX}"
        if not self._inside(path) or not path.resolve().is_file():
            raise RequestError(
                f"no LoRA named {shown!r} in the server's LoRA folder (GET v1/loras lists them).", "loras"
            )
        return path

    def resolve(self, loras) -> list[LoraChoice]:
        """A request's `loras` (`[{"name": ..., "scale": ...}]`, or objects with those attributes) -> choices.
        A name given twice is refused."""
        choices, seen = [], set()
        for item in loras or []:
            name = item["name"] if isinstance(item, dict) else item.name
            scale = item.get("scale", 1.0) if isinstance(item, dict) else item.scale
            path = self.path(name)
            if path.name in seen:
                raise RequestError(f"LoRA {name!r} is listed twice; give it once with the sum of its scales.", "loras")
            seen.add(path.name)
            choices.append(LoraChoice(path.name[: -len(SUFFIX)], path, float(scale)))
        return choices

    def recipes(self, choices: list[LoraChoice]) -> list:
        """The few-step recipes (`recipes.Recipe`) the chosen adapters bring, read from their headers."""
        found = []
        for choice in choices:
            recipe = recipe_for(choice.path.name, self.lora_file(choice).metadata)
            if recipe is not None:
                found.append(recipe)
        return found

    def lora_file(self, choice: LoraChoice) -> LoraFile:
        """The header of a chosen adapter (`lora_formats.LoraFile`: its modules, ranks and shapes, no tensors)."""
        return self._read(choice.name, choice.path)

    def _read(self, name: str, path: Path) -> LoraFile:
        try:
            return read_lora(path, head_dim=self.head_dim, name=name)
        except RequestError:
            raise
        except Exception as error:  # a damaged file: named by its adapter name only
            raise RequestError(f"LoRA {name!r} cannot be read ({type(error).__name__}).", "loras") from None

    def describe(self, name: str) -> dict:
        """One adapter's listing: name, file size, format, ranks, alpha, partitions and recipe (None for an
        ordinary adapter), or an `error` for a file that cannot be read."""
        path = self.path(name)
        stat = path.stat()
        key = (name, stat.st_size, stat.st_mtime_ns)
        if key not in self._described:
            entry = {"name": name, "size": stat.st_size}
            try:
                lora = self._read(name, path)
                recipe = recipe_for(path.name, lora.metadata)
                entry |= {
                    "format": lora.format,
                    "rank": lora.ranks[0] if len(lora.ranks) == 1 else lora.ranks,
                    "alpha": lora.alpha,
                    "alpha_source": lora.alpha_source,
                    "partition": list(lora.partitions),
                    "recipe": recipe.describe() if recipe else None,
                }
            except RequestError as error:
                entry["error"] = str(error)
            self._described = {k: v for k, v in self._described.items() if k[0] != name} | {key: entry}
        return self._described[key]

    def listing(self) -> list[dict]:
        """Every adapter's `describe`, by name."""
        return [self.describe(name) for name in self.names()]
