"""`h3gen worker`: one pipeline (one GPU group) that claims jobs from a fleet's job store and runs them, until SIGTERM
or SIGINT drains it (the running job finishes, or is handed back to the queue past `--drain-seconds`); a second signal
hands the running job back at once.

With `--tp` / `--ulysses` the worker relaunches itself under torchrun: rank 0 claims and reports, the other ranks
follow it (`h3gen.server.distributed`). The process the user started stays as the group's front: a signal to it
drains the group through a file that rank 0 watches (torchrun itself, signalled, would stop its ranks within 30 s).
"""

import argparse
import os
import signal
import sys

from h3gen.cli.arguments import (
    DTYPES,
    DefaultsFormatter,
    merge_lora_argument,
    run_option_arguments,
    run_options_of_args,
)
from h3gen.cli.group import start_serving_group
from h3gen.cli.progress import quiet_libraries
from h3gen.errors import RequestError
from h3gen.options import WORKFLOW_HELP, WORKFLOWS, describe


def add_parser(commands) -> None:
    """Adds `worker` and its flags to the subcommands."""
    worker = commands.add_parser(
        "worker",
        help="run jobs of a fleet's job store on this machine's GPUs",
        formatter_class=DefaultsFormatter,
        description="Load one pipeline and run the jobs of a job store (SQLite file or PostgreSQL URL) that it can "
        "serve; API nodes (`h3gen serve --workers 0`) take the requests.",
    )
    worker.add_argument(
        "--store",
        required=True,
        help="the fleet's job store: postgresql://user@host/db, or the results folder of an `h3gen serve` on this "
        "machine (its jobs.sqlite3)",
    )
    worker.add_argument(
        "--results-dir",
        dest="results_dir",
        required=True,
        help="the folder every node of the fleet mounts: uploads are read and MP4s written there",
    )
    worker.add_argument("--fleet", default="h3gen", help="the fleet's name; a store of another fleet is refused")
    worker.add_argument("--model", help="local MiniMax-H3 checkpoint folder (default: the tiny random demo model)")
    worker.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    worker.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    run_option_arguments(worker, "the tier of jobs that name none (default lossless)")
    worker.add_argument(
        "--max-seconds", dest="max_seconds", type=float, default=60.0, help="longest clip this worker takes, 15 to 300"
    )
    worker.add_argument(
        "--workflow",
        choices=WORKFLOWS,
        default="auto",
        help=f"tasks to serve (default auto): {describe(WORKFLOW_HELP)}",
    )
    worker.add_argument("--lora-dir", dest="lora_dir", default=None, metavar="DIR", help="the adapters it serves")
    worker.add_argument("--lora-gpu-memory", dest="lora_gpu_memory", default=None, metavar="SIZE")
    merge_lora_argument(worker)
    worker.add_argument(
        "--drain-seconds",
        dest="drain_seconds",
        type=float,
        default=600.0,
        help="on SIGTERM, how long the running job may take to finish before it is handed back to the queue",
    )
    worker.add_argument(
        "--lease-seconds",
        dest="lease_seconds",
        type=float,
        default=30.0,
        help="how long this worker may go without renewing its lease before its job is taken back (it renews it "
        "three times per lease)",
    )
    worker.add_argument("--name", default=None, help="this worker's id in the store (default: host and a suffix)")
    worker.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (processes started with torchrun)")
    worker.add_argument(
        "--ulysses", type=int, default=1, help="Ulysses sequence-parallel degree (processes started with torchrun)"
    )
    worker.add_argument("--drain-file", dest="drain_file", default=None, help=argparse.SUPPRESS)  # rank 0's drain
    worker.set_defaults(run=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    """Carries out `h3gen worker` until a signal drains it. Returns the exit code."""
    import threading

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_libraries()
    import torch

    from h3gen.pipelines.h3 import check_max_seconds
    from h3gen.server.engine import H3Engine
    from h3gen.server.job_files import JobFiles
    from h3gen.server.job_worker import JobWorker
    from h3gen.server.store import StoreMismatch, open_store

    if args.model is None:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        args.model = str(tiny_checkpoint())
    check_max_seconds(args.max_seconds)
    if args.drain_seconds < 0:
        raise RequestError(f"--drain-seconds must be 0 or more (got {args.drain_seconds}).", "drain_seconds")
    if args.lease_seconds <= 0:
        raise RequestError(f"--lease-seconds must be more than 0 (got {args.lease_seconds}).", "lease_seconds")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    serving = {
        "options": run_options_of_args(args, workflow=args.workflow),
        "max_seconds": args.max_seconds,
        "lora_dir": args.lora_dir,
        "lora_gpu_memory": args.lora_gpu_memory,
        "merge_loras": args.merge_loras,
    }
    distributed = args.tp * args.ulysses > 1
    if distributed:
        rank = start_serving_group(args, lambda: _run_group(args), serving, dtype, followers_ignore_signals=True)
        if rank.exit_code is not None:
            return rank.exit_code
        parallel, device = rank.parallel, rank.device
    files = JobFiles(args.results_dir)
    try:
        store = open_store(args.store, fleet=args.fleet)
    except StoreMismatch as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        return 2
    if distributed:
        from h3gen.server.distributed import DistributedEngine

        engine = DistributedEngine(args.model, parallel=parallel, device=device, dtype=dtype, **serving)
    else:
        engine = H3Engine(args.model, device=args.device, dtype=dtype, **serving)
    worker = JobWorker(
        store, engine, files, worker_id=args.name, lease_seconds=args.lease_seconds, fail_jobs_on_load_error=False
    )
    stop = threading.Event()
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) > 1:  # asked twice: hand the running job back now
            worker.stop(drain=False, timeout=0)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.start()
    print(f"h3gen: worker {worker.worker_id} serving {args.model} from {_shown(args.store)}", file=sys.stderr)
    while not stop.wait(0.5):
        if not worker.alive or (args.drain_file and os.path.exists(args.drain_file)):
            break
    worker.stop(drain=True, drain_seconds=args.drain_seconds)
    if distributed:
        engine.shutdown()  # the other ranks wait for the next job: release them
    store.close()
    if engine.load_error is not None:
        print(f"h3gen: error: the model failed to load: {engine.load_error}", file=sys.stderr)
        return 1
    return 0


def _run_group(args: argparse.Namespace) -> int:
    """Run this worker as a torchrun group and stay its front: the first SIGTERM or SIGINT drains it (rank 0 sees the
    drain file), a second one stops torchrun, whose SIGTERM makes rank 0 hand its job back. Returns the exit code."""
    import tempfile

    from h3gen.parallel.launch import start_torchrun

    with tempfile.TemporaryDirectory(prefix="h3gen-worker-") as folder:
        drain_file = os.path.join(folder, "drain")
        command = ["worker", *args.argv_rest, "--model", args.model, "--drain-file", drain_file]
        group = start_torchrun(args.tp * args.ulysses, command)

        def on_signal(signum, frame):
            if os.path.exists(drain_file):
                group.send_signal(signal.SIGTERM)
            else:
                open(drain_file, "w").close()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return group.wait()


def _shown(location: str) -> str:
    """A store's location without a password."""
    if "://" in location and "@" in location:
        scheme, rest = location.split("://", 1)
        user, _, host = rest.rpartition("@")
        return f"{scheme}://{user.split(':', 1)[0]}@{host}"
    return location
