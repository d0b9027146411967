"""`h3gen serve`: the REST API and the web UI over one engine, in one process or relaunched under torchrun for
`--tp` / `--ulysses`."""

import argparse
import sys

from h3gen.cli.arguments import (
    DTYPES,
    DefaultsFormatter,
    merge_lora_argument,
    run_option_arguments,
    run_options_of_args,
)
from h3gen.cli.group import check_group_degrees, start_serving_group
from h3gen.cli.plan import planner_for
from h3gen.cli.progress import quiet_libraries
from h3gen.errors import RequestError
from h3gen.options import WORKFLOW_HELP, WORKFLOWS, describe


def add_parser(commands) -> None:
    """Adds `serve` and its flags to the subcommands."""
    serve = commands.add_parser(
        "serve",
        help="run the REST API and web UI",
        formatter_class=DefaultsFormatter,
        description="Serve MiniMax-H3 over a REST API (/v1/videos) and a web UI (/ui).",
    )
    serve.add_argument("--model", help="local MiniMax-H3 checkpoint folder (default: the tiny random demo model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument(
        "--api-key",
        dest="api_key",
        help="require Authorization: Bearer <key> on every route but /health; the UI asks for it on its "
        "login page (default: $H3GEN_API_KEY, else no key)",
    )
    serve.add_argument(
        "--forwarded-allow-ips",
        dest="forwarded_allow_ips",
        default=None,
        metavar="IPS",
        help="comma-separated addresses of the reverse proxies whose X-Forwarded-For / "
        "X-Forwarded-Proto headers name the client (* for any); default: none, every request's "
        "client is its TCP peer",
    )
    serve.add_argument("--max-queue", dest="max_queue", type=int, default=16, help="waiting jobs before 429")
    serve.add_argument(
        "--max-plan-queue",
        dest="max_plan_queue",
        type=int,
        default=4,
        help="prompt plans waiting behind the running one before POST /v1/prompts/plan answers 429",
    )
    serve.add_argument("--results-dir", dest="results_dir", default="h3gen-results", help="jobs database and MP4s")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="workers on this machine: 1 runs the model in this process; N > 1 starts N `h3gen worker` processes, "
        "each on its own GPU group (--tp x --ulysses GPUs) of the visible ones; 0 serves the API only, for the "
        "workers of a fleet",
    )
    serve.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="the fleet's job store, postgresql://user@host/db, shared by every API node and worker (default: "
        "SQLite in --results-dir, one machine)",
    )
    serve.add_argument("--fleet", default="h3gen", help="the fleet's name; a store of another fleet is refused")
    serve.add_argument(
        "--lease-seconds",
        dest="lease_seconds",
        type=float,
        default=30.0,
        help="how long a worker may go without renewing its lease before its job is taken back; a worker is "
        "live while it renewed within this time",
    )
    serve.add_argument(
        "--retention-hours",
        dest="retention_hours",
        type=float,
        default=168.0,
        help="finished jobs and their MP4s are deleted after this many hours",
    )
    serve.add_argument(
        "--max-results-gb",
        dest="max_results_gb",
        type=float,
        default=50.0,
        help="the oldest results are deleted when the MP4s take more than this",
    )
    serve.add_argument(
        "--max-upload-mb",
        dest="max_upload_mb",
        type=float,
        default=20.0,
        help="largest uploaded file (keyframe or reference)",
    )
    serve.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    serve.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    run_option_arguments(
        serve,
        "the tier of requests that name none (default lossless); requests may ask exact, "
        "lossless or high, and a server started with fast or fast+high serves only those "
        "two",
    )
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (processes started with torchrun)")
    serve.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel degree")
    serve.add_argument(
        "--max-seconds",
        dest="max_seconds",
        type=float,
        default=60.0,
        help="longest clip a job may ask for, 15 to 300 s; over 15 s a clip is made in overlapping "
        "windows and written as it is made",
    )
    serve.add_argument(
        "--workflow",
        choices=WORKFLOWS,
        default="auto",
        help=f"tasks to serve (default auto): {describe(WORKFLOW_HELP)}",
    )
    serve.add_argument(
        "--planner",
        default=None,
        metavar="SPEC",
        help="enable plan: true jobs and POST /v1/prompts/plan with a K3 planner: tiny (random demo), a "
        "K3 checkpoint folder, or an OpenAI-compatible base URL (default: off)",
    )
    serve.add_argument(
        "--lora-dir",
        dest="lora_dir",
        default=None,
        metavar="DIR",
        help="serve the LoRA adapters (*.safetensors) of this folder: requests name them in `loras` "
        "(GET /v1/loras lists them); names never reach outside it (default: no adapters)",
    )
    serve.add_argument(
        "--lora-gpu-memory",
        dest="lora_gpu_memory",
        default=None,
        metavar="SIZE",
        help="caps the device memory a request's adapters may use, e.g. 4GiB; a request over it is "
        "refused when submitted (default: free device memory less 2 GiB on a GPU, no cap on the "
        "CPU)",
    )
    merge_lora_argument(serve)
    serve.add_argument(
        "--model-name",
        dest="model_name",
        default="MiniMax-H3",
        help="the model's id in OpenAI's API (`model` of /v1/videos, GET /v1/models)",
    )
    serve.add_argument(
        "--no-ui", dest="no_ui", action="store_true", help="do not mount the web UI at /ui (default: mounted)"
    )
    serve.add_argument(
        "--log-level",
        dest="log_level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level",
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Carries out `h3gen serve` until uvicorn stops. Returns the exit code."""
    import os

    for name, value in (
        ("GRADIO_ANALYTICS_ENABLED", "False"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
        ("DO_NOT_TRACK", "1"),
    ):
        os.environ.setdefault(name, value)
    quiet_libraries()
    import torch
    import uvicorn

    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager
    from h3gen.server.lock import FolderBusy
    from h3gen.server.store import StoreMismatch

    if args.model is None:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        print(
            "h3gen: no --model given: serving the built-in tiny demo model (random weights: pictures and sound "
            "are noise).",
            file=sys.stderr,
        )
        args.model = str(tiny_checkpoint())
    if args.workers < 0:
        raise RequestError(f"--workers must be 0 or more (got {args.workers}).", "workers")
    if args.workers > 1:
        from h3gen.server.local_workers import gpu_groups, visible_gpus

        gpu_groups(visible_gpus(), args.workers, args.tp * args.ulysses)  # refuses groups that do not fit
    if args.max_queue < 1:
        raise RequestError(f"--max-queue must be at least 1 (got {args.max_queue}).", "max_queue")
    if args.max_plan_queue < 0:
        raise RequestError(f"--max-plan-queue must be 0 or more (got {args.max_plan_queue}).", "max_plan_queue")
    from h3gen.pipelines.h3 import check_max_seconds

    check_max_seconds(args.max_seconds)
    if args.lora_gpu_memory is not None:
        from h3gen.pipelines.h3 import lora_budget_bytes

        try:
            lora_budget_bytes(args.lora_gpu_memory)
        except RequestError:
            raise RequestError(
                f"--lora-gpu-memory must be a size like 4GiB, 2GB or 512MiB, 0 or more (got {args.lora_gpu_memory!r}).",
                "lora_gpu_memory",
            ) from None
    api_key = args.api_key or os.environ.get("H3GEN_API_KEY") or None
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    serving = {
        "options": run_options_of_args(args, workflow=args.workflow),
        "max_seconds": args.max_seconds,
        "lora_dir": args.lora_dir,
        "lora_gpu_memory": args.lora_gpu_memory,
        "merge_loras": args.merge_loras,
    }
    in_process_group = args.tp * args.ulysses > 1 and args.workers == 1  # else the local workers are the groups
    if args.tp * args.ulysses > 1 and not in_process_group:
        check_group_degrees(args)  # before any local worker starts (an in-process group checks as it starts)
    if in_process_group:
        from h3gen.parallel.launch import relaunch_with_torchrun

        command = ["serve", *args.argv_rest, "--model", args.model]
        rank = start_serving_group(
            args, lambda: relaunch_with_torchrun(args.tp * args.ulysses, command), serving, dtype
        )
        if rank.exit_code is not None:
            return rank.exit_code
        from h3gen.server.distributed import DistributedEngine

        engine = DistributedEngine(args.model, parallel=rank.parallel, device=rank.device, dtype=dtype, **serving)
    else:
        engine = H3Engine(args.model, device=args.device, dtype=dtype, **serving)
    if args.planner:
        engine.planner = planner_for(args.planner, args.device)
    try:
        manager = JobManager(
            engine,
            args.results_dir,
            max_queue=args.max_queue,
            retention_seconds=args.retention_hours * 3600,
            max_results_bytes=int(args.max_results_gb * 2**30),
            owner=f"h3gen serve on http://{args.host}:{args.port}",
            store=args.store,
            fleet=args.fleet,
            local_worker=args.workers == 1,
            lease_seconds=args.lease_seconds,
        )
    except (FolderBusy, StoreMismatch) as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        if in_process_group:
            engine.shutdown()  # the other ranks are waiting for jobs
        return 2
    workers = []
    if args.workers > 1:
        from h3gen.server.local_workers import start_local_workers

        workers = start_local_workers(args, count=args.workers)
    try:
        app = create_app(
            manager,
            api_key=api_key,
            max_upload_bytes=int(args.max_upload_mb * 2**20),
            model_name=args.model,
            model_id=args.model_name,
            max_plan_queue=args.max_plan_queue,
        )
        if not args.no_ui:
            from h3gen.ui import mount_ui  # imports gradio, which only the UI needs

            app = mount_ui(app, manager, api_key=api_key, max_upload_bytes=int(args.max_upload_mb * 2**20))
        where_ui = "no UI" if args.no_ui else "UI at /ui"
        print(
            f"h3gen: serving {args.model} on http://{args.host}:{args.port} ({where_ui}; API key "
            f"{'required' if api_key else 'not set'}; results in {args.results_dir})",
            file=sys.stderr,
        )
        # uvicorn turns SIGTERM and SIGINT into a graceful shutdown, whose lifespan end stops the manager: the
        # running job is handed back to the queue, the database checkpointed and closed, the folder released.
        # Client addresses (what the throttles count by) come from X-Forwarded-For only when the peer is a proxy
        # the operator named: uvicorn's own default trusts it from 127.0.0.1, so any local client could forge one.
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            proxy_headers=bool(args.forwarded_allow_ips),
            forwarded_allow_ips=args.forwarded_allow_ips or "",
        )
    finally:
        manager.stop()  # idempotent; covers a uvicorn that never ran the lifespan
        if workers:
            from h3gen.server.local_workers import stop_local_workers

            stop_local_workers(workers)
    return 0
