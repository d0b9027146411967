"""The `h3gen` command line. User errors print as one line and exit non-zero; no tracebacks."""

import argparse
import sys

from h3gen.errors import CheckpointError, RequestError
from h3gen.options import (
    ATTENTION_BACKENDS,
    OFFLOAD_HELP,
    OFFLOAD_MODES,
    QUALITY_HELP,
    QUALITY_TIERS,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
    WORKFLOW_HELP,
    WORKFLOWS,
    RunOptions,
    describe,
    uses_step_cache,
)
from h3gen.pipelines.h3.step_cache_config import CACHE_HELP, StepCacheConfig

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
REFERENCE_FLAGS = {"--ref-image": "image", "--ref-video": "video", "--ref-audio": "audio"}


class _AppendReference(argparse.Action):
    """`--ref-image/--ref-video/--ref-audio PATH`, repeatable, into one list that keeps the command line's order."""

    def __call__(self, parser, namespace, value, option_string=None):
        references = list(getattr(namespace, self.dest) or [])
        references.append((REFERENCE_FLAGS[option_string], value, option_string))
        setattr(namespace, self.dest, references)


def _references(args: argparse.Namespace) -> list | None:
    from h3gen.pipelines.h3.references import AudioReference, ImageReference, VideoReference

    types = {"image": ImageReference, "video": VideoReference, "audio": AudioReference}
    return [types[kind](path, name=flag) for kind, path, flag in args.references] if args.references else None


def _step_cache(args: argparse.Namespace, tier: str) -> dict | None:
    """The `cache` knobs of the `--cache-*` flags (None when none is given), validated for `tier`."""
    given = {name: getattr(args, f"cache_{name}") for name in ("threshold", "warmup", "max_consecutive")}
    cache = {name: value for name, value in given.items() if value is not None} or None
    if cache is not None and not uses_step_cache(tier):
        raise RequestError(
            f"--cache-threshold, --cache-warmup and --cache-max-consecutive apply to --quality high or "
            f"fast+high (this run is {tier}).",
            "cache",
        )
    if cache is not None:
        StepCacheConfig.from_request(cache)
    return cache


def _cached_summary(output, tier: str) -> str:
    """What the final line says of the step cache: the forwards it skipped (quality high / fast+high)."""
    if not uses_step_cache(tier):
        return ""
    steps = ",".join(str(step) for step in output.cached_steps) or "none"
    return f", {len(output.cached_steps)} of {output.num_forwards} forwards cached (steps {steps})"


def _lora_argument(text: str) -> tuple[str, float]:
    """`--lora PATH[:SCALE]` -> (path, scale); the scale defaults to 1.0."""
    path, _, scale = text.rpartition(":")
    if path:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return text, 1.0


def _loras(args: argparse.Namespace, head_dim: int) -> tuple[list, list]:
    """The `--lora` adapters as `loras=` takes them, and the few-step recipes they bring (read from their headers,
    before any weights load)."""
    from pathlib import Path

    from h3gen.pipelines.h3.lora_formats import read_lora
    from h3gen.pipelines.h3.recipes import recipe_for

    loras, recipes = [], []
    for path, scale in args.lora or []:
        lora = read_lora(path, head_dim=head_dim)
        recipe = recipe_for(Path(path).name, lora.metadata)
        recipes += [recipe] if recipe else []
        loras.append((path, scale))
    return loras, recipes


def _cmd_env(args: argparse.Namespace) -> int:
    from h3gen.envreport import environment_report

    rows = environment_report()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _progress_bar(units: dict[str, int]):
    """A tqdm bar over stages and denoising steps, and the `callback(stage, step, total)` that feeds it. `units`
    gives each stage, in running order, its share of the bar (a stage's own reports are scaled into it). The bar
    names the stage that is running: stages report when they start."""
    from tqdm import tqdm

    order = list(units)
    bar = tqdm(total=sum(units.values()), unit="step", dynamic_ncols=True, file=sys.stderr)

    def callback(stage: str, step: int, stage_total: int) -> None:
        if stage not in units:
            return
        before = sum(units[name] for name in order[: order.index(stage)])
        position = before + units[stage] * min(step, stage_total) // max(stage_total, 1)
        if position > bar.n:
            bar.set_description(stage, refresh=False)
            bar.update(position - bar.n)  # tqdm redraws at most every 0.1 s
        elif bar.desc.removesuffix(": ") != stage:
            bar.set_description(stage)  # a stage that starts: shown at once

    return bar, callback


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` minus the given options and their values (both `--opt v` and `--opt=v`)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in options:
            skip = True
        elif not any(item.startswith(option + "=") for option in options):
            out.append(item)
    return out


def _quiet_libraries() -> None:
    """Keep the CLI's output to our own bar and messages: no per-library progress bars or deprecation chatter."""
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    for library in (transformers_logging, diffusers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()


def _planner(spec: str, device=None, api_key: str | None = None):
    """A planner backend for `--planner` / `plan --model`: "tiny", a K3 folder or an OpenAI-compatible base URL."""
    import os

    from h3gen.pipelines.k3.planner import make_planner

    if spec == "tiny":
        print(
            "h3gen: planning with the tiny demo K3 model: its weights are random, so the planned prompt is noise.",
            file=sys.stderr,
        )
    return make_planner(spec, device=device, api_key=api_key or os.environ.get("H3GEN_PLANNER_API_KEY"))


def _cmd_plan(args: argparse.Namespace) -> int:
    from h3gen.pipelines.k3.planner import PlannerError

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RequestError("--device cuda was asked for but no CUDA device is available.", "device")
    if args.image is not None and not __import__("pathlib").Path(args.image).is_file():
        raise RequestError(f"--image {args.image} does not exist.", "image")
    planner = _planner(args.model, args.device, args.api_key)
    show = (lambda text: print(text, end="", flush=True)) if args.stream else None
    try:
        result = planner.plan(
            args.prompt,
            image=args.image,
            max_tokens=args.max_tokens,
            seed=args.seed,
            temperature=args.temperature,
            on_text=show,
        )
    except PlannerError as error:
        raise RequestError(str(error)) from None
    print() if args.stream else print(result.planned)
    print(
        f"h3gen: planned by {result.backend} in {result.seconds:.1f} s"
        + (f", {result.tokens} tokens" if result.tokens is not None else ""),
        file=sys.stderr,
    )
    return 0


def _workflow(args: argparse.Namespace) -> str:
    """The task `generate`'s arguments ask for: ref2va with references, fl2va with keyframes, else t2va."""
    return "ref2va" if args.references else "fl2va" if (args.image or args.last_image) else "t2va"


def _check_arguments(args: argparse.Namespace) -> RunOptions:
    """The checks that need no model and no torch, made before either loads: the run options (returned), files and
    folders that must exist, the aspect ratio, the length and the windows, the AAC rate."""
    from pathlib import Path

    from h3gen.pipelines.h3.continuation import check_max_seconds, check_seconds, check_windows
    from h3gen.pipelines.h3.geometry import parse_aspect_ratio, resolve_canvas

    options = _run_options(args, workflow=_workflow(args))
    if args.model is not None and not Path(args.model).is_dir():
        problem = "is not a folder" if Path(args.model).exists() else "does not exist"
        raise RequestError(f"--model {args.model} {problem} (a local MiniMax-H3 checkpoint folder).", "model")
    named = [("--image", args.image), ("--last-image", args.last_image)]
    named += [(flag, path) for _, path, flag in args.references or []]
    named += [("--lora", path) for path, _ in args.lora or []]
    for flag, path in named:
        if path is not None and not Path(path).is_file():
            raise RequestError(f"{flag} {path} does not exist.", flag.lstrip("-").replace("-", "_"))
    if args.aspect is not None:
        resolve_canvas(*parse_aspect_ratio(args.aspect))
    max_seconds = check_max_seconds(args.max_seconds)
    if args.seconds is not None:
        check_seconds(args.seconds, max_seconds)
    check_windows(args.window_frames, args.overlap_frames)
    if args.audio_rate not in (32000, 48000):
        raise RequestError(f"--audio-rate must be 32000 or 48000 (got {args.audio_rate}).", "audio_rate")
    return options


def _cmd_generate(args: argparse.Namespace) -> int:
    options = _check_arguments(args)
    import torch

    _quiet_libraries()

    from h3gen.media import MediaError
    from h3gen.pipelines.h3.checkpoint import H3Checkpoint
    from h3gen.pipelines.h3.continuation import check_max_seconds
    from h3gen.pipelines.h3.request import prepare_request, read_transformer_config

    if args.model is None:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        print(
            "h3gen: no --model given: using the built-in tiny demo model. Its weights are random, so the picture "
            "and sound are noise.",
            file=sys.stderr,
        )
        args.model = str(tiny_checkpoint())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device cuda was asked for but no CUDA device is available.", "device")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    references = _references(args)
    workflow = options.workflow
    cache = _step_cache(args, options.quality)
    call = dict(
        image=args.image,
        last_image=args.last_image,
        references=references,
        aspect_ratio=args.aspect,
        seconds=args.seconds,
        num_inference_steps=args.steps,
        forwards=args.forwards,
        video_shift=args.video_shift,
        audio_shift=args.audio_shift,
        seed=args.seed,
        prompts=_prompts(args),
        window_frames=args.window_frames,
        overlap_frames=args.overlap_frames,
    )

    # Check the request against the checkpoint before loading any weights (or starting any process).
    checkpoint = H3Checkpoint.open(args.model)
    checkpoint.require(workflow)
    config = read_transformer_config(checkpoint)
    max_seconds = check_max_seconds(args.max_seconds)
    loras, recipes = _loras(args, config.attention_head_dim)
    request = prepare_request(checkpoint, config, args.prompt, max_seconds=max_seconds, recipes=recipes, **call)
    call["loras"] = loras or None
    if args.planner:
        if args.tp * args.ulysses > 1:
            raise RequestError(
                "--planner does not run under --tp / --ulysses yet; plan first with `h3gen plan` and "
                "pass its output as the prompt.",
                "planner",
            )
        from h3gen.pipelines.k3.planner import PlannerError

        planner = _planner(args.planner, device)
        try:
            args.prompt = planner.plan(
                args.prompt, image=args.image if planner.accepts_images else None, seed=request.seed
            ).planned
        except PlannerError as error:
            raise RequestError(str(error)) from None
        del planner  # its memory goes back before the video model loads
        print(f"h3gen: planned prompt: {args.prompt}", file=sys.stderr)
    parallel, rank = None, 0
    if args.tp * args.ulysses > 1:
        from h3gen.parallel.launch import launched_by_torchrun, relaunch_with_torchrun, start_rank
        from h3gen.parallel.state import check_degrees

        if not launched_by_torchrun():
            check_degrees(config.num_attention_heads, args.tp, args.ulysses)
            return relaunch_with_torchrun(
                args.tp * args.ulysses,
                ["generate", *args.argv_rest, "--model", args.model, "--seed", str(request.seed)],
            )
        parallel, device = start_rank(args.tp, args.ulysses, config.num_attention_heads, device)
        rank = torch.distributed.get_rank()

    from h3gen.pipelines.h3.pipeline import H3Pipeline

    if rank == 0:
        print(f"h3gen: loading {args.model} on {device} ({dtype_name})", file=sys.stderr)
    pipe = H3Pipeline.from_pretrained(
        args.model, device=device, torch_dtype=getattr(torch, DTYPES[dtype_name]), parallel=parallel, options=options
    )
    pipe.max_seconds = max_seconds
    if args.seed is None:
        call["seed"] = request.seed  # the seed drawn during the check, so it can be reported
    if references and args.seconds is None:
        call["num_frames"] = request.shape.num_frames  # the length taken from the references' sound, decoded once
    if rank != 0:  # every rank runs the same steps; rank 0 decodes, reports and writes the file
        pipe(args.prompt, decode=False, cache=cache, **call)
        return 0
    if request.continuation is not None:
        return _generate_long(pipe, args, call, request.continuation.num_windows, request.sampling.forwards)
    bar, callback = _progress_bar(
        {
            "encode_text": 1,
            "encode_conditions": len(request.keyframes) + len(request.references),
            "denoise": request.sampling.forwards,
            "decode_video": 1,
            "decode_audio": 1,
            "write_mp4": 1,
        }
    )
    try:
        output = pipe(
            args.prompt, callback=callback, output_path=args.out, audio_sample_rate=args.audio_rate, cache=cache, **call
        )
        info = output.media
    except torch.cuda.OutOfMemoryError:
        raise RequestError("the GPU ran out of memory: try fewer seconds, a smaller canvas or --dtype bf16.") from None
    except MediaError as error:
        raise RequestError(str(error)) from None
    finally:
        bar.close()
    sampling = output.sampling
    recipe = f", recipe {sampling['recipe']}" if sampling.get("recipe") else ""
    print(
        f"h3gen: wrote {args.out}: {info.num_frames} frames {info.width}x{info.height} at {info.fps:g} fps, "
        f"stereo AAC {info.sample_rate} Hz, {info.video_seconds:.2f} s, seed {output.seed}; "
        f"{sampling['forwards']} transformer forwards ({sampling['num_inference_steps']} sigma points), shifts "
        f"{sampling['video_shift']:g}/{sampling['audio_shift']:g}{recipe}{_cached_summary(output, options.quality)}",
        file=sys.stderr,
    )
    return 0


def _prompts(args: argparse.Namespace) -> list[str] | None:
    """`--prompt-per-window`, repeated, or once as a JSON list."""
    import json

    given = args.prompts
    if given and len(given) == 1 and given[0].lstrip().startswith("["):
        try:
            given = json.loads(given[0])
        except ValueError:
            raise RequestError(
                "--prompt-per-window must be a prompt (repeat the flag) or a JSON list of prompts.", "prompts"
            ) from None
    return given


def _window_bar(windows: int, steps: int):
    """A tqdm bar over a long clip's windows (each: its denoising steps and its write), and its callback."""
    from tqdm import tqdm

    per_window = steps + 1
    bar = tqdm(total=windows * per_window, unit="step", dynamic_ncols=True, file=sys.stderr)
    window = 0

    def callback(stage: str, step: int, stage_total: int) -> None:
        nonlocal window
        if stage == "window":
            window = step
            position = step * per_window
        elif stage == "denoise":
            position = window * per_window + min(step, steps)
        elif stage == "write_mp4" and step == stage_total:
            position = min(window * per_window + per_window, windows * per_window)
        else:
            position = bar.n
        bar.set_description(f"window {min(window + 1, windows)}/{windows} {stage}", refresh=False)
        if position > bar.n:
            bar.update(position - bar.n)

    return bar, callback


def _generate_long(pipe, args: argparse.Namespace, call: dict, windows: int, forwards: int) -> int:
    """Rank 0 of a clip over 15 s: made window by window and streamed into `--out`."""
    import torch

    from h3gen.media import MediaError

    bar, callback = _window_bar(windows, forwards)
    try:
        output = pipe(args.prompt, callback=callback, output_path=args.out, audio_sample_rate=args.audio_rate, **call)
    except torch.cuda.OutOfMemoryError:
        raise RequestError(
            "the GPU ran out of memory: try a smaller canvas, a shorter window or --dtype bf16."
        ) from None
    except MediaError as error:
        raise RequestError(str(error)) from None
    finally:
        bar.close()
    info = output.media
    print(
        f"h3gen: wrote {args.out}: {info.num_frames} frames {info.width}x{info.height} at {info.fps:g} fps in "
        f"{windows} windows, stereo AAC {info.sample_rate} Hz, {info.video_seconds:.2f} s, seed {output.seed}",
        file=sys.stderr,
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    for name, value in (
        ("GRADIO_ANALYTICS_ENABLED", "False"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
        ("DO_NOT_TRACK", "1"),
    ):
        os.environ.setdefault(name, value)
    _quiet_libraries()
    import torch
    import uvicorn

    from h3gen.server.app import create_app
    from h3gen.server.engine import H3Engine
    from h3gen.server.jobs import JobManager
    from h3gen.server.lock import FolderBusy

    if args.model is None:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        print(
            "h3gen: no --model given: serving the built-in tiny demo model (random weights: pictures and sound "
            "are noise).",
            file=sys.stderr,
        )
        args.model = str(tiny_checkpoint())
    if args.max_queue < 1:
        raise RequestError(f"--max-queue must be at least 1 (got {args.max_queue}).", "max_queue")
    if args.max_plan_queue < 0:
        raise RequestError(f"--max-plan-queue must be 0 or more (got {args.max_plan_queue}).", "max_plan_queue")
    from h3gen.pipelines.h3.continuation import check_max_seconds

    check_max_seconds(args.max_seconds)
    if args.lora_gpu_memory is not None:
        from h3gen.pipelines.h3.lora_registry import lora_budget_bytes

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
        "options": _run_options(args, workflow=args.workflow),
        "max_seconds": args.max_seconds,
        "lora_dir": args.lora_dir,
        "lora_gpu_memory": args.lora_gpu_memory,
    }
    if args.tp * args.ulysses > 1:
        from h3gen.parallel.launch import launched_by_torchrun, relaunch_with_torchrun, start_rank
        from h3gen.parallel.state import check_degrees
        from h3gen.pipelines.h3.checkpoint import H3Checkpoint
        from h3gen.pipelines.h3.request import read_transformer_config

        heads = read_transformer_config(H3Checkpoint.open(args.model)).num_attention_heads
        if not launched_by_torchrun():
            check_degrees(heads, args.tp, args.ulysses)
            return relaunch_with_torchrun(args.tp * args.ulysses, ["serve", *args.argv_rest, "--model", args.model])
        parallel, device = start_rank(args.tp, args.ulysses, heads, args.device)
        if torch.distributed.get_rank() != 0:
            from h3gen.server.distributed import follow

            follow(args.model, parallel=parallel, device=device, dtype=dtype, **serving)
            return 0
        from h3gen.server.distributed import DistributedEngine

        engine = DistributedEngine(args.model, parallel=parallel, device=device, dtype=dtype, **serving)
    else:
        engine = H3Engine(args.model, device=args.device, dtype=dtype, **serving)
    if args.planner:
        engine.planner = _planner(args.planner, args.device)
    try:
        manager = JobManager(
            engine,
            args.results_dir,
            max_queue=args.max_queue,
            retention_seconds=args.retention_hours * 3600,
            max_results_bytes=int(args.max_results_gb * 2**30),
            owner=f"h3gen serve on http://{args.host}:{args.port}",
        )
    except FolderBusy as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        if args.tp * args.ulysses > 1:
            engine.shutdown()  # the other ranks are waiting for jobs
        return 2
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
        # running job is recorded as interrupted, the database checkpointed and closed, the folder released.
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
    return 0


def _run_option_arguments(parser: argparse.ArgumentParser, quality_help: str) -> None:
    """The `RunOptions` flags (`h3gen.options` holds their values and rules)."""
    parser.add_argument(
        "--quality", choices=QUALITY_TIERS, default="lossless", help=f"{describe(QUALITY_HELP)}; {quality_help}"
    )
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default="none", help=describe(OFFLOAD_HELP))
    parser.add_argument(
        "--gpu-memory",
        dest="gpu_memory",
        default=None,
        help="GPU memory the transformer may use with --offload layerwise, e.g. 30GiB (needed there; default: unset)",
    )
    parser.add_argument("--prefetch", type=int, default=2, help="blocks copied ahead with --offload layerwise")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help=f"{describe(QUANTIZATION_HELP)} (default: the checkpoint's dtype)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="attention backend for the lossless and fast tiers instead of the tier's own choice "
        "(FP8 backends with --quality fast only; default: the tier's own)",
    )


def _long_video_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of clips over 15 s (`pipelines/h3/continuation.py` holds their rules)."""
    from h3gen.pipelines.h3.continuation import (
        DEFAULT_MAX_SECONDS,
        DEFAULT_OVERLAP_FRAMES,
        DEFAULT_WINDOW_FRAMES,
        MAX_SECONDS_LIMIT,
    )

    parser.add_argument(
        "--max-seconds",
        dest="max_seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help=f"longest clip a request may ask for, 15 to {MAX_SECONDS_LIMIT:g} s (default {DEFAULT_MAX_SECONDS:g})",
    )
    parser.add_argument(
        "--window-frames",
        dest="window_frames",
        type=int,
        default=None,
        help=f"a clip over 15 s: frames per window, 17n+5 from 124 to 345 (default {DEFAULT_WINDOW_FRAMES})",
    )
    parser.add_argument(
        "--overlap-frames",
        dest="overlap_frames",
        type=int,
        default=None,
        help=f"a clip over 15 s: frames each window repeats of the previous one, 17n+5, shorter than "
        f"the window (default {DEFAULT_OVERLAP_FRAMES})",
    )


def _run_options(args: argparse.Namespace, **keywords) -> RunOptions:
    """The validated `RunOptions` of the command line's flags."""
    return RunOptions(
        quality=args.quality,
        offload=args.offload,
        gpu_memory=args.gpu_memory,
        prefetch=args.prefetch,
        quantization=args.quantization,
        attention=args.attention,
        **keywords,
    )


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless it has no value to show (None, a bare switch) or already says
    its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    import h3gen

    parser = argparse.ArgumentParser(prog="h3gen", description="MiniMax-H3 video + audio generation.")
    parser.add_argument("--version", action="version", version=f"h3gen {h3gen.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    env = commands.add_parser("env", help="print versions, devices and codecs")
    env.set_defaults(run=_cmd_env)

    gen = commands.add_parser(
        "generate", help="generate an MP4 with stereo audio from a prompt (and keyframes or references)"
    )
    gen.add_argument("prompt", help="what to generate, used verbatim")
    gen.add_argument("--model", help="local MiniMax-H3 checkpoint folder (default: the tiny random demo model)")
    gen.add_argument("--image", help="keyframe the video starts on (fl2va)")
    gen.add_argument("--last-image", dest="last_image", help="keyframe the video ends on (fl2va)")
    for flag, what in (
        ("--ref-image", "an image (subject, style, scene; up to 9)"),
        ("--ref-video", "a video (motion, camera; its soundtrack too; up to 3)"),
        ("--ref-audio", "an audio clip (voice, music; up to 3, not alone)"),
    ):
        gen.add_argument(
            flag,
            dest="references",
            action=_AppendReference,
            metavar="PATH",
            help=f"ref2va reference: {what}; repeatable, references keep the command line's order",
        )
    gen.add_argument("--aspect", default=None, help="W:H from 1:4 to 4:1 (default 16:9, or the keyframe's)")
    gen.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="length, 5 to --max-seconds (default 5; ref2va: the length of the first reference with "
        "sound); over 15 s the clip is made in overlapping windows",
    )
    _long_video_arguments(gen)
    gen.add_argument(
        "--prompt-per-window",
        dest="prompts",
        action="append",
        metavar="PROMPT",
        help="a clip over 15 s: the prompt of the next window (repeat once per window, or give one "
        "for all, or a JSON list); default: the prompt for every window",
    )
    gen.add_argument(
        "--steps",
        type=int,
        default=None,
        help="sigma grid points as diffusers counts them (num_inference_steps), 2 to 1000: N points run "
        "N - 1 transformer forwards (default 50, or the recipe's of a few-step LoRA)",
    )
    gen.add_argument(
        "--forwards",
        type=int,
        default=None,
        help="transformer forwards (SGLang's and vLLM-Omni's step count), 1 to 999, instead of --steps",
    )
    gen.add_argument(
        "--video-shift",
        dest="video_shift",
        type=float,
        default=None,
        help="video schedule shift (default: the model's, 12, or the recipe's)",
    )
    gen.add_argument(
        "--audio-shift",
        dest="audio_shift",
        type=float,
        default=None,
        help="audio schedule shift (default: the model's, 3, or the recipe's)",
    )
    gen.add_argument(
        "--lora",
        action="append",
        type=_lora_argument,
        metavar="PATH[:SCALE]",
        help="apply a LoRA adapter (.safetensors, any MiniMax-H3 format) at SCALE (default 1.0); "
        "repeatable, adapters stack. A few-step adapter (LightX2V Turbo, FlashGen) brings its "
        "recipe: its forwards and shifts, unless --steps / --forwards say otherwise (refused)",
    )
    gen.add_argument("--seed", type=int, default=None, help="noise seed (default: random, printed at the end)")
    gen.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    gen.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    gen.add_argument("--audio-rate", dest="audio_rate", type=int, default=32000, help="AAC rate, 32000 or 48000")
    _run_option_arguments(gen, "default lossless")
    for name, kind in (("threshold", float), ("warmup", int), ("max_consecutive", int)):
        gen.add_argument(
            f"--cache-{name.replace('_', '-')}",
            dest=f"cache_{name}",
            type=kind,
            default=None,
            help=f"with --quality high or fast+high: {CACHE_HELP[name]}",
        )
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (processes started with torchrun)")
    gen.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel degree")
    gen.add_argument(
        "--planner",
        default=None,
        metavar="SPEC",
        help="first rewrite the prompt with a K3 planner: tiny (random demo), a K3 checkpoint folder, or "
        "an OpenAI-compatible base URL (key in $H3GEN_PLANNER_API_KEY)",
    )
    gen.add_argument("--out", required=True, help="output .mp4 path")
    gen.set_defaults(run=_cmd_generate)

    serve = commands.add_parser(
        "serve",
        help="run the REST API and web UI",
        formatter_class=_DefaultsFormatter,
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
    _run_option_arguments(
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
    serve.set_defaults(run=_cmd_serve)

    plan = commands.add_parser(
        "plan",
        help="turn a short idea into an H3 prompt (picture, motion, camera, sound, "
        "music, dialogue) with a K3 planner; prints it",
    )
    plan.add_argument("prompt", help="the idea")
    plan.add_argument("--image", help="an image the video starts on (needs a planner that reads images)")
    plan.add_argument(
        "--model",
        default="tiny",
        help="K3 checkpoint folder, tiny (the random demo model, default), or an OpenAI-compatible base "
        "URL such as http://host:8000/v1",
    )
    plan.add_argument("--api-key", dest="api_key", help="key for a remote planner (or $H3GEN_PLANNER_API_KEY)")
    plan.add_argument("--max-tokens", dest="max_tokens", type=int, default=512, help="most tokens to write")
    plan.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    plan.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.6)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    plan.add_argument("--stream", action="store_true", help="print the text as it is written")
    plan.set_defaults(run=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv_rest = _without(argv[1:], ("--model", "--seed"))  # for relaunching the same command under torchrun
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (RequestError, CheckpointError) as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("h3gen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
