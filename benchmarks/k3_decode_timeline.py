"""A K3 decode step kernel by kernel: the captured decode graph of `bench_k3.py`'s mid config replayed under
`torch.profiler`, each kernel's start, end and marginal time (its end minus the latest end before it: what the
step would lose without it, in a chain where kernels overlap their neighbours' starts), summed by kernel name.
Complements `k3_decode_breakdown.py` (marginal costs by skipping whole op families).

    python benchmarks/k3_decode_timeline.py [--batch 1] [--replays 6] [--listing]
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_k3

from h3gen.loading.load import keeps_fp32
from h3gen.pipelines.k3.demo_model import randomize
from h3gen.pipelines.k3.engine import K3Engine, SamplingParams
from h3gen.pipelines.k3.model import K3ForCausalLM


def step_kernels(events: list, replays: int) -> list:
    """The kernel records of the fastest replay after the first two (warm caches): a list of (name, start us, end
    us) relative to the replay's first kernel."""
    events = sorted(events, key=lambda e: e.time_range.start)
    per_step = len(events) // replays
    steps = [events[i * per_step : (i + 1) * per_step] for i in range(replays)]
    best = min(steps[2:] or steps, key=lambda s: max(e.time_range.end for e in s) - s[0].time_range.start)
    origin = best[0].time_range.start
    return [(e.name, e.time_range.start - origin, e.time_range.end - origin) for e in best]


def marginal_times(kernels: list) -> list:
    """(name, start, end, duration, marginal) per kernel: marginal = end - the latest end of the kernels before."""
    latest = 0.0
    rows = []
    for name, start, end in kernels:
        rows.append((name, start, end, end - start, end - latest))
        latest = max(latest, end)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--replays", type=int, default=6, help="graph replays profiled (the fastest is shown)")
    parser.add_argument("--listing", action="store_true", help="also print every kernel of the step in order")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("k3_decode_timeline needs a CUDA GPU (it profiles the captured decode graph)", file=sys.stderr)
        return
    device = torch.device("cuda")
    config = bench_k3.mid_config(False)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=device), seed=0).to(torch.bfloat16).eval()
    for name, param in model.named_parameters():
        if keeps_fp32(name, K3ForCausalLM.keep_fp32_modules):
            param.data = param.data.float()
    engine = K3Engine(model, max_batch=args.batch, prefix_cache=False, page_size=64, chunk_size=2048, max_context=2048)
    for prompt in bench_k3.prompts(args.batch, 128, config.vocab_size, seed=1):
        engine.add_request(prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(8 + args.batch):  # prefills, then decode steps (the graph is captured in the first)
        engine.step()
    graph, _ = engine.graphs.graphs[next(s for s in engine.graphs.sizes if s >= args.batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    print(f"graph replay (unprofiled): {(time.perf_counter() - start) / 50 * 1e3:.4f} ms", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = step_kernels([e for e in prof.events() if e.device_type.name == "CUDA"], args.replays)
    rows = marginal_times(kernels)
    print(f"kernels per step {len(rows)}, profiled step {rows[-1][2]:.1f} us")
    totals = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, _, _, duration, marginal in rows:
        entry = totals[name[:70]]
        entry[0] += 1
        entry[1] += marginal
        entry[2] += duration
    print("count | marginal us | duration us | kernel")
    for name, (count, marginal, duration) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{count:5d} | {marginal:11.1f} | {duration:11.1f} | {name}")
    if args.listing:
        print("\norder | start | end | duration | marginal | kernel")
        for i, (name, start_us, end_us, duration, marginal) in enumerate(rows):
            print(f"{i:5d} | {start_us:7.1f} | {end_us:7.1f} | {duration:8.2f} | {marginal:8.2f} | {name[:70]}")


if __name__ == "__main__":
    main()
