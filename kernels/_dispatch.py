"""When a public kernel function takes its Triton path: CUDA tensors with Triton importable, or everywhere when
`H3GEN_TRITON=1` (with `TRITON_INTERPRET=1` that runs the Triton code on the CPU, which is how tests check it);
`H3GEN_TRITON=0` forces the torch reference.

Each op's public function imports its Triton module inside the function, on the first Triton call: triton is
optional (no wheel outside Linux), and Triton reads `TRITON_INTERPRET` when a kernel is defined, so tests set it
before the first call rather than before the first import of h3gen."""

import importlib.util
import os

import torch

# Decided once at import (a plain constant, so torch.compile traces `use_triton` without a cache wrapper).
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return TRITON_AVAILABLE


def use_triton(tensor: torch.Tensor) -> bool:
    forced = os.environ.get("H3GEN_TRITON")
    if forced == "0":
        return False
    if forced == "1":
        return triton_available()
    return tensor.is_cuda and triton_available()


def next_power_of_2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()
