"""Shared benchmark helpers: CUDA-event timing (warm-up, median), error metrics, table printing."""

import statistics
import time

import torch

MATMUL_PEAK_TFLOPS = 777.0  # bf16, measured on the H200; the bench scripts measure it again in their own run


def time_cuda(fn, *, warmup: int = 3, repeat: int = 10, setup=None) -> float:
    """Median milliseconds of `fn()` over `repeat` runs after `warmup`, timed with CUDA events; `setup()` runs
    before each run, outside the timed region."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if setup:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timer(device: torch.device, warmup: int = 1):
    """`(fn, repeat) -> median milliseconds of fn()`: CUDA events after `warmup` runs on a GPU, the wall clock after
    one run elsewhere (a `--tiny` run on the CPU only shows that a script works end to end)."""
    if device.type == "cuda":
        return lambda fn, repeat: time_cuda(fn, warmup=warmup, repeat=repeat)

    def wall(fn, repeat):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def matmul_peak_tflops(size: int = 8192) -> float:
    """Measured bf16 GEMM rate on random data (TFLOP/s)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: a @ b, warmup=3, repeat=10)
    return 2 * size**3 / ms / 1e9


def print_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns) for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text
