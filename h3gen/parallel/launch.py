"""Starting a multi-process run: the CLI relaunches itself under torchrun, and each rank joins the process group
(NCCL on GPUs, one per rank; gloo on CPUs) with a collective timeout, so a failing rank cannot hang the others."""

import datetime
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

from h3gen.parallel.state import ParallelState, init_parallel

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start_torchrun(processes: int, cli_args: list[str]) -> subprocess.Popen:
    """Start `h3gen <cli_args>` in `processes` processes on this host with torchrun (its own free port, so several
    groups can run side by side); returns the torchrun process."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "h3gen.cli",
        *cli_args,
    ]
    return subprocess.Popen(command)


def relaunch_with_torchrun(processes: int, cli_args: list[str]) -> int:
    """Run `h3gen <cli_args>` in `processes` processes on this host with torchrun; returns its exit code."""
    process = start_torchrun(processes, cli_args)
    try:
        return process.wait()
    except KeyboardInterrupt:  # pass Ctrl-C on, so torchrun stops its ranks cleanly
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def start_rank(tp: int, sp: int, heads: int, device: str | None) -> tuple[ParallelState, str]:
    """Join the process group torchrun set up; returns this rank's `ParallelState` and its device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        device = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return init_parallel(tp, sp, heads), device
