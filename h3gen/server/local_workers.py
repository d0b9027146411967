"""`h3gen serve --workers N` on one machine: N `h3gen worker` processes on the server's store and results folder,
each on its own GPU group of the visible ones (`--tp` x `--ulysses` GPUs; with no GPU, all on the CPU). They run in
process groups of their own, are stopped with SIGTERM when the server stops (a running job is handed back to the
queue), and killed if they do not end within the drain time."""

import os
import signal
import subprocess
import sys

from h3gen.errors import RequestError

DRAIN_SECONDS = 30.0  # how long a stopping server lets its local workers finish their jobs


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (its value, else 0 .. count - 1)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [name for name in given.split(",") if name.strip()]
    try:
        import torch

        return [str(index) for index in range(torch.cuda.device_count())]
    except ImportError:
        return []


def worker_command(args, index: int) -> list[str]:
    """The `h3gen worker` command line of local worker `index`, with the server's model, run options and limits."""
    store = args.store or os.path.abspath(args.results_dir)
    command = [sys.executable, "-m", "h3gen.cli", "worker", "--store", store, "--fleet", args.fleet]
    command += ["--results-dir", os.path.abspath(args.results_dir), "--model", args.model]
    command += ["--max-seconds", str(args.max_seconds), "--workflow", args.workflow, "--drain-seconds", "0"]
    command += ["--name", f"{os.uname().nodename}-local{index}", "--lease-seconds", str(args.lease_seconds)]
    command += ["--tp", str(args.tp), "--ulysses", str(args.ulysses)]
    for flag, value in (
        ("--device", args.device),
        ("--dtype", args.dtype),
        ("--quality", args.quality),
        ("--offload", args.offload),
        ("--gpu-memory", args.gpu_memory),
        ("--quantization", args.quantization),
        ("--attention", args.attention),
        ("--lora-dir", args.lora_dir),
        ("--lora-gpu-memory", args.lora_gpu_memory),
    ):
        if value is not None:
            command += [flag, str(value)]
    for path in getattr(args, "merge_loras", None) or []:
        command += ["--merge-lora", os.path.abspath(path)]
    if getattr(args, "prefetch", None) is not None:
        command += ["--prefetch", str(args.prefetch)]
    return command


def gpu_groups(gpus: list[str], count: int, per_worker: int) -> list[str | None]:
    """Each worker's CUDA_VISIBLE_DEVICES: consecutive groups of `per_worker` of `gpus`; None for every worker (all
    see the same devices) when one GPU each was asked for and fewer than `count` are visible, or when there is no GPU.
    Raises `RequestError` when groups of several GPUs do not fit."""
    if not gpus:
        return [None] * count
    if len(gpus) < count * per_worker:
        if per_worker == 1:
            return [None] * count
        raise RequestError(
            f"--workers {count} with {per_worker} GPUs each needs {count * per_worker} GPUs; {len(gpus)} are visible "
            "(CUDA_VISIBLE_DEVICES).",
            "workers",
        )
    return [",".join(gpus[index * per_worker : (index + 1) * per_worker]) for index in range(count)]


def start_local_workers(args, count: int) -> list[subprocess.Popen]:
    """Start `count` workers, worker i on GPU group i of the visible ones (`gpu_groups`)."""
    groups = gpu_groups(visible_gpus(), count, args.tp * args.ulysses)
    workers = []
    for index, group in enumerate(groups):
        environment = dict(os.environ)
        if group is not None:
            environment["CUDA_VISIBLE_DEVICES"] = group
        workers.append(subprocess.Popen(worker_command(args, index), env=environment, start_new_session=True))
    return workers


def stop_local_workers(workers: list[subprocess.Popen], drain_seconds: float = DRAIN_SECONDS) -> None:
    """SIGTERM each worker's process group (a running job is handed back to the queue), then SIGKILL what is left
    after `drain_seconds`."""
    for worker in workers:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
    for worker in workers:
        try:
            worker.wait(drain_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
