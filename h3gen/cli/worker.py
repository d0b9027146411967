"""`h3gen worker`: one pipeline (one GPU group) that claims jobs from a fleet's job store and runs them, until SIGTERM
or SIGINT drains it (the running job finishes, or is handed back to the queue past `--drain-seconds`)."""

import argparse
import sys

from h3gen.cli.arguments import DTYPES, DefaultsFormatter, run_option_arguments, run_options_of_args
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
    worker.set_defaults(run=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    """Carries out `h3gen worker` until a signal drains it. Returns the exit code."""
    import os
    import signal
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
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    engine = H3Engine(
        args.model,
        device=args.device,
        dtype=dtype,
        options=run_options_of_args(args, workflow=args.workflow),
        max_seconds=args.max_seconds,
        lora_dir=args.lora_dir,
        lora_gpu_memory=args.lora_gpu_memory,
    )
    files = JobFiles(args.results_dir)
    try:
        store = open_store(args.store, fleet=args.fleet)
    except StoreMismatch as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        return 2
    if args.lease_seconds <= 0:
        raise RequestError(f"--lease-seconds must be more than 0 (got {args.lease_seconds}).", "lease_seconds")
    worker = JobWorker(
        store, engine, files, worker_id=args.name, lease_seconds=args.lease_seconds, fail_jobs_on_load_error=False
    )
    stop = threading.Event()

    def drain(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    worker.start()
    print(f"h3gen: worker {worker.worker_id} serving {args.model} from {_shown(args.store)}", file=sys.stderr)
    while not stop.wait(0.5):
        if not worker.alive:
            break
    worker.stop(drain=True, drain_seconds=args.drain_seconds)
    store.close()
    if engine.load_error is not None:
        print(f"h3gen: error: the model failed to load: {engine.load_error}", file=sys.stderr)
        return 1
    return 0


def _shown(location: str) -> str:
    """A store's location without a password."""
    if "://" in location and "@" in location:
        scheme, rest = location.split("://", 1)
        user, _, host = rest.rpartition("@")
        return f"{scheme}://{user.split(':', 1)[0]}@{host}"
    return location
