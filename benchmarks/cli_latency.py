"""How long the command line takes on this machine, each command in a fresh process (median of `--repeat`).

Times `h3gen --help`, three refused arguments (`--aspect 5:1`, `--seconds 3`, a missing keyframe), `h3gen env`, and
the README's Quick start (`h3gen generate "a cat playing the piano in a jazz bar" --out demo.mp4`) warm (the tiny
demo model cached) and cold (an empty `H3GEN_CACHE`: the first use builds the model). Then, in one more fresh
process, the Quick start's request through the Python API with each stage timed from its progress reports.
Prints one table with the goals of each figure; no GPU is used.

    python benchmarks/cli_latency.py [--repeat 3] [--skip-cold]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUICK_START = ["generate", "a cat playing the piano in a jazz bar", "--out", "demo.mp4"]
# (label, arguments, expected exit code, goal in seconds or None)
COMMANDS = [
    ("h3gen --help", ["--help"], 0, 2.0),
    ("generate --aspect 5:1 (refused)", ["generate", "x", "--aspect", "5:1", "--out", "x.mp4"], 2, 3.0),
    ("generate --seconds 3 (refused)", ["generate", "x", "--seconds", "3", "--out", "x.mp4"], 2, 3.0),
    ("generate --image missing.png (refused)", ["generate", "x", "--image", "missing.png", "--out", "x.mp4"], 2, 3.0),
    ("h3gen env", ["env"], 0, None),
    ("Quick start, warm", QUICK_START, 0, 20.0),
]

STAGES_SCRIPT = """
import json, sys, time
import h3gen

pipe = h3gen.H3Pipeline.from_pretrained(h3gen.tiny_checkpoint())
starts = {}
def callback(stage, step, total):
    starts.setdefault(stage, time.perf_counter())
begin = time.perf_counter()
pipe("a cat playing the piano in a jazz bar", callback=callback, output_path=sys.argv[1])
end = time.perf_counter()
order = sorted(starts, key=starts.get)
stops = [starts[name] for name in order[1:]] + [end]
print(json.dumps({name: stop - starts[name] for name, stop in zip(order, stops)}))
"""


def run(arguments: list[str], cwd: Path, env: dict, expected: int) -> float:
    """Seconds one fresh `python -m h3gen.cli ARGUMENTS` process takes; its exit code must be `expected`."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "h3gen.cli", *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    seconds = time.perf_counter() - start
    if done.returncode != expected:
        raise SystemExit(
            f"h3gen {' '.join(arguments)} exited {done.returncode}, expected {expected}:\n{done.stderr[-2000:]}"
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per command (median)")
    parser.add_argument("--skip-cold", action="store_true", help="leave out the cold Quick start (a model build)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="h3gen-cli-latency-"))
    cache = work / "cache"
    env = dict(os.environ, H3GEN_CACHE=str(cache), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    rows = []
    if not args.skip_cold:
        colds = []
        for index in range(args.repeat):
            cold_env = dict(env, H3GEN_CACHE=str(work / f"cold-{index}"))
            colds.append(run(QUICK_START, work, cold_env, 0))
        rows.append(("Quick start, cold (builds the model)", statistics.median(colds), 45.0))
    run(QUICK_START, work, env, 0)  # builds the cache the warm runs read
    for label, arguments, expected, goal in COMMANDS:
        rows.append((label, statistics.median(run(arguments, work, env, expected) for _ in range(args.repeat)), goal))

    stages = subprocess.run(
        [sys.executable, "-c", STAGES_SCRIPT, str(work / "stages.mp4")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if stages.returncode != 0:
        raise SystemExit(stages.stderr[-2000:])
    stage_seconds = json.loads(stages.stdout.strip().splitlines()[-1])

    print(f"{'command (fresh process each, median of ' + str(args.repeat) + ')':<48} {'seconds':>8} {'goal':>6}")
    for label, seconds, goal in rows:
        verdict = "" if goal is None else ("  ok" if seconds <= goal else "  OVER")
        print(f"{label:<48} {seconds:>8.2f} {'' if goal is None else f'{goal:g}':>6}{verdict}")
    print(f"\n{'Quick start request, stage (Python API)':<48} {'seconds':>8}")
    for stage, seconds in stage_seconds.items():
        print(f"{stage:<48} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
