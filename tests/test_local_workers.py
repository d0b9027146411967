"""`h3gen serve --workers N` shares the visible GPUs out: one GPU per worker, or consecutive groups of `--tp` x
`--ulysses` GPUs, each worker told its own through CUDA_VISIBLE_DEVICES and started with the server's degrees."""

import argparse

import pytest

from h3gen.errors import RequestError
from h3gen.server.local_workers import gpu_groups, worker_command


def test_groups_of_several_gpus_are_consecutive_and_must_fit():
    assert gpu_groups(["0", "1", "2", "3", "4", "5", "6", "7"], 4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_groups(["3", "5", "6"], 1, 2) == ["3,5"]  # the rest stay idle
    assert gpu_groups(["0", "1"], 2, 1) == ["0", "1"]
    assert gpu_groups(["0"], 3, 1) == [None, None, None]  # one GPU each but too few: all share what is visible
    assert gpu_groups([], 2, 4) == [None, None]  # no GPU: every group on the CPU
    with pytest.raises(RequestError, match=r"--workers 3 with 2 GPUs each needs 6 GPUs; 4 are visible"):
        gpu_groups(["0", "1", "2", "3"], 3, 2)


def test_a_local_worker_runs_with_the_servers_degrees_and_options():
    args = argparse.Namespace(
        store=None,
        results_dir="results",
        fleet="h3gen",
        model="/models/h3",
        max_seconds=60.0,
        workflow="t2va",
        lease_seconds=30.0,
        tp=2,
        ulysses=2,
        device=None,
        dtype="bf16",
        quality="fast",
        offload=None,
        gpu_memory=None,
        quantization=None,
        attention=None,
        lora_dir=None,
        lora_gpu_memory=None,
    )
    command = worker_command(args, 1)
    assert command[command.index("--tp") + 1] == "2" and command[command.index("--ulysses") + 1] == "2"
    assert command[command.index("--quality") + 1] == "fast" and "--device" not in command
    assert command[command.index("--name") + 1].endswith("-local1")
