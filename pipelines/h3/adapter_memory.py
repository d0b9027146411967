"""Device memory a pipeline's LoRA adapters may still take, as seen from a request handler.

The figure is `h3gen.device_memory.available_device_memory` (the driver's free memory plus what PyTorch's
allocator caches unused). A REST server validates a request while another may be running, whose activations fill the
device for the duration of that call only. `DeviceMemory` therefore measures live while no call runs and otherwise
answers with the figure taken when the last call ended (or when the idle pipeline was entered or built). Each figure
includes what the adapters of each transformer partition held at that instant (`held`), since a new set replaces them.
"""

import functools
import threading
from contextlib import contextmanager
from typing import Callable

import torch

from h3gen.device_memory import available_device_memory


class DeviceMemory:
    """The memory adapters on a partition may take: `available(partition)` bytes, or None off CUDA.

    `held()` returns the bytes each partition's active adapters hold now (`{partition: bytes}`). Wrap every call of
    the pipeline in `running()` (see `tracks_device_memory`)."""

    def __init__(self, device, held: Callable[[], dict[str, int]]):
        self.device = torch.device(device)
        self.held = held
        self._lock = threading.Lock()
        self._calls = 0
        self._snapshot = self._measure()

    def _measure(self) -> tuple[int | None, dict[str, int]]:
        return available_device_memory(self.device), self.held()

    def available(self, partition: str) -> int | None:
        """Free device memory plus what `partition`'s adapters hold: measured now when no call runs, else as
        measured when the last call ended."""
        with self._lock:
            free, held = self._measure() if self._calls == 0 else self._snapshot
        return None if free is None else free + held.get(partition, 0)

    @contextmanager
    def running(self):
        """Around one call: a busy pipeline answers from the last figure, taken again when the call ends."""
        with self._lock:
            if self._calls == 0:  # idle until now: the live figure is the one to answer with meanwhile
                self._snapshot = self._measure()
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                self._snapshot = self._measure()


def tracks_device_memory(call):
    """Decorate a pipeline's `__call__` so that its `device_memory` (a `DeviceMemory`) knows a call is running and
    measures again when it ends, however it ends."""

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        with self.device_memory.running():
            return call(self, *args, **kwargs)

    return wrapper
