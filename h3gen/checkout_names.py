"""Keep the checkout's top-level folders from shadowing installed distributions.

`kernels/`, `pipelines/`, `offload/` and `ui/` install as `h3gen.kernels`, `h3gen.pipelines`, ... (pyproject.toml,
`package-dir`). When the checkout root is on `sys.path` (`python -m pytest`, `python -m h3gen.cli`, a REPL opened
there), Python would also find them as top-level `kernels`, `ui`, ... ahead of site-packages, and a library that
imports the PyPI distribution of that name (transformers imports `kernels`) would get ours. Each folder's
`__init__.py` calls `defer_to_installed` when it is imported under its bare name: the installed distribution of
that name takes its place, or the import fails as if the folder were not there.

Standard library only: it runs before anything heavy is imported.
"""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def defer_to_installed(name: str, folder: str) -> None:
    """Load the installed top-level module `name` in place of the checkout folder `folder` being imported.

    Args:
        name: the bare module name being imported (`"kernels"`).
        folder: the `__file__` of the folder's `__init__.py`, whose parent's parent is the checkout root.

    Replaces `sys.modules[name]` with the installed module, which the import statement then returns (the import
    system reads `sys.modules` again after a module's body runs). Raises `ModuleNotFoundError` when no other
    location on `sys.path` holds `name`.
    """
    root = Path(folder).resolve().parent.parent
    elsewhere = [entry for entry in sys.path if _resolved(entry) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r}: the folder {name}/ of this checkout is h3gen.{name} (import it by that name)",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry or os.getcwd()).resolve()
    except (OSError, RuntimeError):
        return None
