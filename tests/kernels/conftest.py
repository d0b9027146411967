"""Every kernel test runs on a CUDA GPU when one is present (in the interpreter on a CPU): all of them carry the
`gpu` marker, so `python -m pytest -m gpu` on a GPU machine runs them with the other GPU tests."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
