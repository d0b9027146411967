"""Progress (and cancellation) points inside one long call of a model."""

from contextlib import contextmanager
from typing import Callable


@contextmanager
def checkpoints(modules, check: Callable[[], None]):
    """Run `check()` before each forward of `modules`: progress (and cancellation) points inside one long call. An
    exception `check` raises propagates out of the call; the hooks are removed either way."""
    handles = [module.register_forward_pre_hook(lambda *_: check()) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
