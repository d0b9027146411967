"""The first-block step cache (quality high) on a MiniMax-H3 transformer at released dims with random weights, on
one 5 s 768x1344 t2va packed sequence (37,838 rows).

- `--what step`: one forward timed three ways in the same process: plain lossless (no cache), computed under the
  cache (block 0's residual kept and compared, the tail kept: the cache's overhead on a computed forward) and cached
  (block 0, the diff, the stored tail added). Goal: a cached forward costs at most 3 % of a plain one.
- `--what request`: a 49-forward request (50 sigma points) run as the pipeline's loop runs it (AdaLN tables for the
  whole request first, Euler steps on the video and audio rows), its cache decisions forced to `--pattern`, against
  the same loop without cache; resident, or with `--offload` under layer-wise offload planned for `--gpu-memory`
  (the 32 GiB profile: 30GiB, `--quantization mxfp4`). The plan (resident / streamed blocks) is printed; the copies
  of blocks are counted per forward, so a cached forward's count (block 0's at most) is shown.

Pattern (`--pattern`): neither SGLang nor vLLM-Omni publishes which forwards Cache-DiT caches on an H3 request, nor
a hit rate; their settings (warm-up 4, threshold 0.04, at most 1 cached in a row) bound it. `ceiling` (default) is
that bound under this project's rule: over 49 forwards, forwards 4, 6, ..., 46 cached (22 of 49, 45 %), the rest
computed (the last always is). `cache-dit` is the bound under Cache-DiT's own run counter (runs of two after the
first, the last forward cacheable: 30 of 49). A real request caches a subset of either, chosen by its residuals;
this project has no trained weights to measure that with. Or give a comma-separated list of forward indices.

The forced decisions go through the cache's test and benchmark hook (`StepCache(forced=...)`, via
`step_cache(..., forced=...)`): the diff is still measured on every forward, as the rule would.

    python benchmarks/bench_step_cache.py --what step
    python benchmarks/bench_step_cache.py --what request
    python benchmarks/bench_step_cache.py --what request --offload --gpu-memory 30GiB --quantization mxfp4
    python benchmarks/bench_step_cache.py --tiny      # all of it at tiny size on the CPU (a smoke run)
"""

import argparse
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2, synchronize, timer

from h3gen.offload import apply_layerwise_offload
from h3gen.pipelines.h3.packing import build_layout, row_timesteps
from h3gen.pipelines.h3.random_weights import random_tensors
from h3gen.pipelines.h3.schedules import AUDIO_SHIFT, VIDEO_SHIFT, FlowSchedule
from h3gen.pipelines.h3.step_cache import step_cache
from h3gen.pipelines.h3.step_cache_config import StepCacheConfig
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

GiB = 2**30
ROWS = 37838
TINY = H3TransformerConfig(
    num_attention_heads=4,
    attention_head_dim=24,
    hidden_size=56,
    num_layers=6,
    num_refiner_layers=2,
    ffn_dim=100,
    text_dim=40,
    freq_dim=16,
    time_embed_hidden_dim=48,
    time_embed_dim=24,
    rope_freq_dim=4,
)


def patterns(forwards: int) -> dict[str, list[int]]:
    """The named cache patterns (see the module docstring) for a request of `forwards` forwards."""
    warmup, ceiling = 4, []
    for step in range(warmup, forwards - 1):
        if not ceiling or ceiling[-1] != step - 1:
            ceiling.append(step)
    # Cache-DiT's counter (cache_context.add_cached_step): advanced only by a cached forward right after another
    # (by 2 the first time) or by the very first; reset when it reaches the cap and refuses a forward.
    cachedit, run = [], 0
    for step in range(warmup, forwards):
        if run >= 1:
            run = 0
            continue
        if cachedit and cachedit[-1] == step - 1:
            run += 2 if run == 0 else 1
        elif not cachedit:
            run += 1
        cachedit.append(step)
    return {"ceiling": ceiling, "cache-dit": cachedit}


# ---------------------------------------------------------------------------------------------------- set-up


def random_transformer(config: H3TransformerConfig, device, dtype, quantization: str | None, seed: int = 0):
    """An `H3Transformer` with random weights, made on `device` through the real loader one tensor at a time
    (`random_weights.random_tensors`; MXFP4 linears quantized as they arrive)."""
    folder = Path(tempfile.mkdtemp(prefix="h3gen-bench-step-cache-"))
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return H3Transformer.from_pretrained(
        folder,
        torch_dtype=dtype,
        device=device,
        quantization=quantization,
        tensors=random_tensors(config, dtype=dtype, seed=seed),
    )


def request_inputs(config: H3TransformerConfig, rows: int, forwards: int, device, dtype, text_rows: int = 128):
    """A 768x1344 5 s t2va layout (37 latent frames, 207 audio latents, `text_rows` text rows) with its video rows
    cut so the sequence has `rows` rows: the forward's fixed keywords, the noise rows, and per forward its
    distinct timesteps and per-row indices (the video and audio schedules of a `forwards + 1`-point grid)."""
    frames, height, width, audio = (37, 48, 84, 207) if rows > 1000 else (3, 8, 8, 7)
    layout = build_layout(text_rows, frames, height, width, audio, patch_size=config.patch_size)
    audio_rows = 2 * audio
    video_rows = rows - text_rows - audio_rows
    if not 0 < video_rows <= layout.video_indices.numel():
        raise SystemExit(f"--rows must be from {text_rows + audio_rows + 1} to {layout.position_ids.shape[0]}")
    keep = torch.arange(text_rows + audio_rows + video_rows)
    g = torch.Generator(device=device).manual_seed(1)
    fixed = dict(
        encoder_hidden_states=torch.randn(1, text_rows, config.text_dim, device=device, generator=g).to(dtype),
        token_tags=layout.token_tags[keep].to(device),
        position_ids=layout.position_ids[keep].to(device),
        video_indices=torch.arange(text_rows + audio_rows, rows, device=device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )
    video = torch.randn(video_rows, config.video_patch_dim, device=device, generator=g)
    sound = torch.randn(audio_rows, config.audio_in_channels, device=device, generator=g)
    video_schedule = FlowSchedule.make(forwards + 1, VIDEO_SHIFT)
    audio_schedule = FlowSchedule.make(forwards + 1, AUDIO_SHIFT)
    plan = []
    for i in range(forwards):
        video_t, audio_t = float(video_schedule.timesteps[i]), float(audio_schedule.timesteps[i])
        timestep, indices = row_timesteps(layout, video_t, audio_t, video_t)
        plan.append((timestep.to(device), indices[keep].to(device)))
    return fixed, video, sound, plan, (video_schedule, audio_schedule)


def forward(model, fixed, video, sound, plan, tables, step):
    timestep, indices = plan[step]
    return model(
        hidden_states=video[None],
        audio_hidden_states=sound[None],
        timestep=timestep,
        timestep_indices=indices,
        adaln_tables=tables,
        step=step,
        return_dict=False,
        **fixed,
    )


# ---------------------------------------------------------------------------------------------------- runs


def run_step(args, model, device, dtype):
    """Plain, computed-under-cache and cached forward times (ms) and their ratios."""
    fixed, video, sound, plan, _ = request_inputs(model.config, args.rows, 2, device, dtype)
    tables = model.precompute_adaln([t for t, _ in plan])
    measure = timer(device)
    with torch.no_grad():
        plain_ms = measure(lambda: forward(model, fixed, video, sound, plan, tables, 0), args.repeat)
        n = 2 * (args.repeat + 2)
        with step_cache(model, StepCacheConfig(), n, forced=[False] * n):
            forward(model, fixed, video, sound, plan, tables, 0)  # a computed forward: the residuals exist
            computed_ms = measure(lambda: forward(model, fixed, video, sound, plan, tables, 1), args.repeat)
        with step_cache(model, StepCacheConfig(), n, forced=[False] + [True] * (n - 1)):
            forward(model, fixed, video, sound, plan, tables, 0)
            cached_ms = measure(lambda: forward(model, fixed, video, sound, plan, tables, 1), args.repeat)
    return [
        {"forward": "plain lossless (no cache)", "ms": f"{plain_ms:.1f}", "x plain": "1.000"},
        {"forward": "computed under the cache", "ms": f"{computed_ms:.1f}", "x plain": f"{computed_ms / plain_ms:.4f}"},
        {
            "forward": "cached (block 0 + diff + stored tail)",
            "ms": f"{cached_ms:.1f}",
            "x plain": f"{cached_ms / plain_ms:.4f}",
            "goal": "<= 0.03",
            "met": "yes" if cached_ms / plain_ms <= 0.03 else "no",
        },
    ]


def run_request(args, model, device, dtype, cached: list[int], label: str):
    """Denoise time (s) of `args.forwards` forwards without cache and with the decisions forced to `cached`;
    copies of blocks per forward under offload."""
    fixed, video0, sound0, plan, (video_schedule, audio_schedule) = request_inputs(
        model.config, args.rows, args.forwards, device, dtype
    )
    offload = getattr(model, "offload", None)
    log = offload.copy_log if offload is not None else None
    starts = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda *_: starts.append(len(log) if log is not None else 0), prepend=True
    )

    def loop(forced):
        video, sound = video0.clone(), sound0.clone()
        synchronize(device)
        started = time.perf_counter()
        tables = model.precompute_adaln([t for t, _ in plan])
        with step_cache(model, StepCacheConfig(), args.forwards, forced=forced) if forced else nullcontext() as cache:
            for i in range(args.forwards):
                video_v, audio_v = forward(model, fixed, video, sound, plan, tables, i)
                video = video_schedule.step(i, video_v[0].float(), video)
                sound = audio_schedule.step(i, audio_v[0].float(), sound)
        synchronize(device)
        return time.perf_counter() - started, video, (cache.cached_steps if cache is not None else [])

    forced = [step in set(cached) for step in range(args.forwards)]
    rows = []
    with torch.no_grad():
        # One untimed forward first: kernels compiled and tuned, allocator warm, for both loops alike.
        forward(model, fixed, video0, sound0, plan, model.precompute_adaln([t for t, _ in plan]), 0)
        if not args.skip_plain:
            plain_s, plain_video, _ = loop(None)
            rows.append(
                {"run": f"{label}: no cache", "denoise s": f"{plain_s:.2f}", "x no cache": "1.000", "cached": "0"}
            )
        del starts[:]
        first = len(log) if log is not None else 0
        cached_s, video, got = loop(forced)
        assert got == sorted(cached), (got, cached)
    copies = ""
    if log is not None:
        bounds = starts[-args.forwards :] + [len(log)]
        per = [bounds[i + 1] - bounds[i] for i in range(args.forwards)]
        on_cached = sorted({per[s] for s in cached})
        on_computed = [per[s] for s in range(args.forwards) if s not in cached]
        copies = (
            f"{len(log) - first} copies; per cached forward {on_cached}, per computed forward "
            f"{min(on_computed)}-{max(on_computed)}"
        )
    row = {
        "run": f"{label}: forced pattern",
        "denoise s": f"{cached_s:.2f}",
        "cached": f"{len(cached)}",
        "copies of blocks": copies,
    }
    if not args.skip_plain:
        row["x no cache"] = f"{cached_s / plain_s:.3f}"
        row["relL2 video vs no cache"] = f"{rel_l2(video, plain_video):.2e}"
    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", choices=("step", "request", "all"), default="all")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--layers", type=int, default=50, help="transformer blocks (released: 50)")
    parser.add_argument("--forwards", type=int, default=49, help="forwards of the request (50 sigma points: 49)")
    parser.add_argument(
        "--pattern",
        default="ceiling",
        help="ceiling, cache-dit, or comma-separated forward indices to cache (see the docstring)",
    )
    parser.add_argument("--offload", action="store_true", help="the request under layer-wise offload")
    parser.add_argument("--gpu-memory", default="30GiB", help="the offload budget (the 32 GiB profile: 30GiB)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument(
        "--quantization",
        choices=("mxfp4", "none"),
        default=None,
        help="block linears (default: mxfp4 with --offload, bf16 otherwise)",
    )
    parser.add_argument("--skip-plain", action="store_true", help="time only the cached request (saves GPU time)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU (a smoke run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    if args.tiny:
        device, dtype, config = torch.device("cpu"), torch.float32, TINY
        args.rows = min(args.rows, 128 + 14 + 48)
        if args.gpu_memory == "30GiB":
            args.gpu_memory = None  # sized below: two resident blocks and the ring
        torch.set_num_threads(2)
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = H3TransformerConfig(num_layers=args.layers)
    quantization = args.quantization or ("mxfp4" if args.offload else "none")
    quantization = None if quantization == "none" else quantization
    weights = quantization or str(dtype).removeprefix("torch.")
    named = patterns(args.forwards)
    cached = named[args.pattern] if args.pattern in named else sorted(int(s) for s in args.pattern.split(",") if s)
    if cached and (cached[0] < 1 or cached[-1] >= args.forwards):
        raise SystemExit(f"--pattern forwards must be from 1 to {args.forwards - 1}")
    print(f"pattern {args.pattern}: {len(cached)} of {args.forwards} forwards cached: {cached}", flush=True)

    results, started = [], time.perf_counter()
    label = f"resident, {weights}"
    if args.what in ("step", "all") or not args.offload:
        model = random_transformer(config, device, dtype, quantization)
        set_quality(model, "lossless")
        print(f"built {config.num_layers} blocks ({weights}) in {time.perf_counter() - started:.0f} s", flush=True)
        if args.what in ("step", "all"):
            results += run_step(args, model, device, dtype)
            print_table(results, ["forward", "ms", "x plain", "goal", "met"])
        if args.what in ("request", "all") and not args.offload:
            results += run_request(args, model, device, dtype, cached, label)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.what in ("request", "all") and (args.offload or args.tiny):
        model = random_transformer(config, device, dtype, quantization)
        model.transformer_blocks.to("cpu")  # offload takes the blocks from the host
        set_quality(model, "lossless")
        budget = args.gpu_memory
        if budget is None:  # tiny: the non-block weights, two resident blocks and the ring
            block = sum(
                t.numel() * t.element_size()
                for n, t in model.transformer_blocks[0].state_dict().items()
                if not n.startswith("adaln_proj")
            )
            other = sum(
                p.numel() * p.element_size()
                for n, p in model.named_parameters()
                if not n.startswith("transformer_blocks.")
            )
            budget = int((other + (2 + args.prefetch + 1) * block) / 0.8) + 1
        apply_layerwise_offload(model, device, gpu_memory=budget, prefetch=args.prefetch, copy_log=[])
        plan = model.offload_plan
        where = (
            f"layer-wise {args.gpu_memory or budget}, {weights}: {len(plan.resident)} resident "
            f"(block 0 {'resident' if 0 in plan.resident else 'streamed'}) + {len(plan.streamed)} streamed"
        )
        print(where, flush=True)
        results += run_request(args, model, device, dtype, cached, where)
    request_rows = [r for r in results if "run" in r]
    if request_rows:
        print()
        print_table(
            request_rows, ["run", "denoise s", "x no cache", "cached", "relL2 video vs no cache", "copies of blocks"]
        )
    if args.out:
        args.out.write_text(json.dumps({"pattern": cached, "rows": results}, indent=2))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\n{name}, {args.rows} rows, {config.num_layers} blocks, {args.forwards} forwards, "
        f"{time.perf_counter() - started:.0f} s in all",
        flush=True,
    )


if __name__ == "__main__":
    main()
