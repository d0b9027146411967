"""Folders built once and reused: the tiny demo checkpoints, cached under `$H3GEN_CACHE` (default `~/.cache/h3gen`)."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    """`$H3GEN_CACHE` or `~/.cache/h3gen`."""
    return Path(os.environ.get("H3GEN_CACHE") or Path.home() / ".cache" / "h3gen")


def cached_folder(target: Path, marker: str, build: Callable[[Path, Path], None]) -> Path:
    """`target` if it holds `marker` (the file written last); else `build(staging, target)` fills a fresh staging
    folder beside it, which is then renamed into place atomically, so a crash never leaves a half folder and
    concurrent builders agree (the first rename wins; the others keep the winner's folder)."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging, target)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
