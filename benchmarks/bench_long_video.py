"""A clip longer than 15 s against what its windows cost one by one, and its memory against a 15 s request.

Runs in one process, on one pipeline:
  1. one window alone: a plain request of `--window-frames` frames (decoded and written to an MP4);
  2. a 15 s request (345 frames, the longest plain one), for its peak memory;
  3. the long request (`--seconds`, default 30): windowed, decoded and streamed to an MP4 window by window.
Prints the long request's wall time against windows x one window's time (the overhead of continuation: the guide
rows each window adds, the per-window text/condition work, the piecewise decode and the streamed write), and its
peak GPU memory (and the process's peak host RSS) against the 15 s request's. Each number is also in the JSON
written with `--json`.

    python benchmarks/bench_long_video.py --model /path/to/MiniMax-H3 --seconds 30 --quality lossless
    python benchmarks/bench_long_video.py --random --seconds 30     # random weights at the released dims
    python benchmarks/bench_long_video.py --tiny      # the built-in tiny random model on the CPU, a small canvas
"""

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from h3gen.pipelines.h3.continuation import DEFAULT_OVERLAP_FRAMES, DEFAULT_WINDOW_FRAMES, plan_windows
from h3gen.pipelines.h3.geometry import FPS, MAX_FRAMES, align_num_frames


def _peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _run(pipe, label: str, out: Path, **kwargs) -> dict:
    """One call, timed, with the device's peak memory from its start."""
    device = pipe.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    windows = []
    started = time.perf_counter()
    output = pipe(
        kwargs.pop("prompt"),
        output_path=out,
        callback=lambda stage, step, total: windows.append(step) if stage == "window" else None,
        **kwargs,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak_gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    info = output.media
    print(
        f"{label}: {seconds:.1f} s, {info.num_frames} frames ({info.video_seconds:.2f} s), audio "
        f"{info.audio_seconds:.2f} s, windows {output.windows}"
        + (f", peak GPU {peak_gpu:.2f} GiB" if peak_gpu is not None else "")
        + f", peak host RSS so far {_peak_host_gib():.2f} GiB; stages "
        + ", ".join(f"{name} {value:.1f}" for name, value in output.timings.items()),
        flush=True,
    )
    return {
        "seconds": seconds,
        "frames": info.num_frames,
        "video_seconds": info.video_seconds,
        "audio_seconds": info.audio_seconds,
        "windows": output.windows,
        "peak_gpu_gib": peak_gpu,
        "timings": output.timings,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="MiniMax-H3 checkpoint folder (diffusers layout)")
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny random model on the CPU, 64x64")
    parser.add_argument(
        "--random",
        action="store_true",
        help="random weights at the released dims (random_pipeline), no checkpoint needed",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the long request (default 30)")
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        help="sigma grid points per window (N - 1 forwards; default 4: the ratio hardly depends on it)",
    )
    parser.add_argument("--window-frames", type=int, default=DEFAULT_WINDOW_FRAMES)
    parser.add_argument("--overlap-frames", type=int, default=DEFAULT_OVERLAP_FRAMES)
    parser.add_argument("--quality", default="lossless", help="exact, lossless or fast (default lossless)")
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from h3gen.pipelines.h3.pipeline import H3Pipeline

    if args.tiny:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        args.model, args.height, args.width, args.device = str(tiny_checkpoint()), 64, 64, args.device or "cpu"
    if args.model is None and not args.random:
        parser.error("give --model PATH, --random or --tiny")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.random:
        from h3gen.pipelines.h3.random_weights import random_pipeline

        pipe = random_pipeline(device, torch_dtype=dtype, quality=args.quality)
    else:
        pipe = H3Pipeline.from_pretrained(args.model, device=device, torch_dtype=dtype, quality=args.quality)
    pipe.max_seconds = max(pipe.max_seconds, args.seconds)
    common = dict(
        prompt="a red fox runs through fresh snow, wind howling",
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        seed=args.seed,
    )
    total = align_num_frames(int(round(args.seconds * FPS)))
    windows = plan_windows(total, args.window_frames, args.overlap_frames)
    print(
        f"h3gen long video: {args.seconds:g} s = {total} frames in {len(windows)} windows of "
        f"{args.window_frames} (overlap {args.overlap_frames}) at {args.width}x{args.height}, {args.steps - 1} "
        f"forwards per window, {device} {dtype}, quality {args.quality}",
        flush=True,
    )

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        _run(pipe, "warm-up (one window)", out / "warm.mp4", num_frames=args.window_frames, **common)
        window = _run(pipe, "one window", out / "window.mp4", num_frames=args.window_frames, **common)
        plain = _run(pipe, "15 s request", out / "plain.mp4", num_frames=MAX_FRAMES, **common)
        long = _run(
            pipe,
            f"{args.seconds:g} s request",
            out / "long.mp4",
            seconds=args.seconds,
            window_frames=args.window_frames,
            overlap_frames=args.overlap_frames,
            **common,
        )

    expected = len(windows) * window["seconds"]
    rows = [
        ("long request wall time", f"{long['seconds']:.1f} s"),
        (f"windows x one window ({len(windows)} x {window['seconds']:.1f} s)", f"{expected:.1f} s"),
        ("ratio (long / windows x window)", f"{long['seconds'] / expected:.3f}"),
        ("video / audio of the long MP4", f"{long['video_seconds']:.2f} s / {long['audio_seconds']:.2f} s"),
    ]
    if long["peak_gpu_gib"] is not None:
        rows += [
            ("peak GPU, long request", f"{long['peak_gpu_gib']:.2f} GiB"),
            ("peak GPU, 15 s request", f"{plain['peak_gpu_gib']:.2f} GiB"),
            ("ratio (long / 15 s)", f"{long['peak_gpu_gib'] / plain['peak_gpu_gib']:.3f}"),
        ]
    rows.append(("peak host RSS of the process", f"{_peak_host_gib():.2f} GiB"))
    width = max(len(name) for name, _ in rows)
    print("\n| measure" + " " * (width - 7) + " | value |\n|" + "-" * (width + 2) + "|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {"window": window, "plain_15s": plain, "long": long, "windows": len(windows), "args": vars(args)},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
