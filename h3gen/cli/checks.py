"""The checks of the command line's arguments: those of `generate` that need no model and no torch, made before
either loads, and the `--cache-*` knobs of the step cache."""

import argparse

from h3gen.cli.arguments import run_options_of_args
from h3gen.errors import RequestError
from h3gen.options import RunOptions, uses_step_cache
from h3gen.pipelines.h3 import StepCacheConfig


def workflow_of_args(args: argparse.Namespace) -> str:
    """The task `generate`'s arguments ask for: ref2va with references, fl2va with keyframes, else t2va."""
    return "ref2va" if args.references else "fl2va" if (args.image or args.last_image) else "t2va"


def check_generate_arguments(args: argparse.Namespace) -> RunOptions:
    """The checks that need no model and no torch, made before either loads: the run options (returned), files and
    folders that must exist, the aspect ratio, the length and the windows, the AAC rate."""
    from pathlib import Path

    from h3gen.pipelines.h3 import (
        MAX_PREVIEW_EVERY,
        check_max_seconds,
        check_seconds,
        check_windows,
        parse_aspect_ratio,
        resolve_canvas,
    )

    options = run_options_of_args(args, workflow=workflow_of_args(args))
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
    if args.preview_every is not None:
        if args.preview is None:
            raise RequestError("--preview-every needs --preview FILE (where the previews go).", "preview_every")
        if not 1 <= args.preview_every <= MAX_PREVIEW_EVERY:
            raise RequestError(
                f"--preview-every must be from 1 to {MAX_PREVIEW_EVERY} forwards (got {args.preview_every}).",
                "preview_every",
            )
    if args.preview is not None and not Path(args.preview).resolve().parent.is_dir():
        raise RequestError(f"--preview {args.preview}: its folder does not exist.", "preview")
    return options


def step_cache_of_args(args: argparse.Namespace, tier: str) -> dict | None:
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
