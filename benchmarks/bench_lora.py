"""Unmerged LoRA cost on a MiniMax-H3 denoising step at released dims: rank-128 adapters on every block's attention
and FFN (LightX2V Turbo's shape: to_q, to_k, to_v, to_out.0, ff.net.0.proj, ff.net.2, and the two token-refiner
blocks), written as a Turbo-format file and loaded through `LoraRegistry` as a request would.

Per row count (37,838 = a 5 s 768x1344 t2va sequence; 8,192), on random weights:
  - our step without and with the adapter, lossless and fast tiers, each also with its updates outside its GEMMs
    instead of inside them (`activate(..., inside_gemm=False)`: written before the lossless tier's GEMMs, added
    after the fast tier's FP8 ones), and how far the adapter's change of the output in each is from its change in
    diffusers;
  - diffusers' `MiniMaxH3Transformer3DModel` without and with the same file loaded by its own H3 LoRA loader (PEFT);
  - the 50-block step estimated, as in bench_h3_step.py, as (0-block step) + 50 x per-block time;
  - switching the adapter set between requests (two registered adapters, host LRU -> device), and the first use of
    a file (read and convert);
  - the adapters' device memory and the step's peak memory with and without them.
`--tiny` runs the same on the CPU at tiny dims (wall-clock timing) to check the script end to end.

    python benchmarks/bench_lora.py --layers 4 --rows 37838 8192 [--rounds 4]
    python benchmarks/bench_lora.py --layers 4 --rows 8192 --profile    # which kernels the adapters add
    python benchmarks/bench_lora.py --tiny
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_h3_step import cast_with_islands, inputs
from common import print_table, rel_l2, synchronize, timer
from safetensors.torch import save_file

from h3gen.pipelines.h3.lora_registry import LoraRegistry, activate, check_targets, deactivate
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

TURBO_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
TINY = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=64,
    num_refiner_layers=2,
    ffn_dim=128,
    text_dim=64,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=4,
)


def write_turbo_file(path: Path, model: H3Transformer, rank: int, seed: int) -> None:
    """A LightX2V-Turbo-shaped peft dump (`<module>.lora_A.default.weight`) for `model`'s blocks, bf16."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(TURBO_MODULES) and name.startswith(("transformer_blocks.", "token_refiner.")):
            # Distilled-adapter magnitudes: far below the weights (which are ~N(0, 0.02) here).
            down = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            up = torch.randn(module.out_features, rank, generator=generator) * 1e-2
            tensors[f"{name}.lora_A.default.weight"] = down.bfloat16()
            tensors[f"{name}.lora_B.default.weight"] = up.bfloat16()
    save_file(tensors, str(path), metadata={"alpha": str(rank)})


def small_weights_(model, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.copy_((torch.randn(param.shape, generator=generator) * 0.02).to(param.dtype))


def kernel_us(fn, device, repeat: int = 3) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel `fn()` launches (by kernel name), from `torch.profiler` over
    `repeat` calls after one warm-up; empty off CUDA."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        synchronize(device)
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / repeat
    return totals


def kernel_delta_rows(
    rows: int, tier: str, without: dict[str, float], with_lora: dict[str, float], top: int = 14
) -> list[dict]:
    """The kernels whose time per step the adapters change most (with minus without), for the table `--profile`
    prints, and their sum."""
    names = set(without) | set(with_lora)
    delta = {name: with_lora.get(name, 0.0) - without.get(name, 0.0) for name in names}
    chosen = sorted(delta, key=lambda name: -abs(delta[name]))[:top]
    out = [
        {
            "rows": rows,
            "tier": tier,
            "kernel": name[:90],
            "us without": f"{without.get(name, 0.0):.0f}",
            "us with": f"{with_lora.get(name, 0.0):.0f}",
            "delta us": f"{delta[name]:+.0f}",
        }
        for name in chosen
    ]
    out.append(
        {
            "rows": rows,
            "tier": tier,
            "kernel": "all kernels",
            "us without": f"{sum(without.values()):.0f}",
            "us with": f"{sum(with_lora.values()):.0f}",
            "delta us": f"{sum(delta.values()):+.0f}",
        }
    )
    return out


def kernel_step_ms(empty: dict[str, float], full: dict[str, float], layers: int, blocks: int = 50) -> float:
    """The `blocks`-block step's summed kernel time (ms), from the `kernel_us` of the 0-block and `layers`-block
    models as the wall-time estimate extrapolates."""
    zero = sum(empty.values())
    return (zero + blocks * (sum(full.values()) - zero) / layers) / 1000


def peak_bytes(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return torch.cuda.max_memory_allocated(device)


def build(config: H3TransformerConfig, device, dtype):
    from diffusers import MiniMaxH3Transformer3DModel  # heavy optional dependency

    reference = MiniMaxH3Transformer3DModel(**{k: v for k, v in config.to_dict().items() if not k.startswith("_")})
    small_weights_(reference)
    reference = cast_with_islands(reference, dtype).to(device).eval()
    ours = cast_with_islands(H3Transformer(config), dtype).to(device).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def diffusers_with_lora(reference, path: Path):
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin  # heavy optional dependency

    class Holder(MiniMaxH3LoraLoaderMixin):
        hf_device_map = None

        @property
        def components(self):
            return {"transformer": self.transformer}

    holder = Holder()
    holder.transformer, holder.transformer_ref = reference, None
    holder.load_lora_weights(str(path), adapter_name="turbo")
    return reference


def measure(layers: int, rows: int, args, device, dtype, folder: Path) -> dict:
    """Step times (ms) of every variant for one model size and row count, plus switch times and memory."""
    base_config = dict(TINY) if args.tiny else {}
    config = H3TransformerConfig(num_layers=layers, **base_config)
    reference, ours = build(config, device, dtype)
    files = [folder / f"turbo_{layers}_{i}.safetensors" for i in range(2)]
    for seed, path in enumerate(files):
        write_turbo_file(path, ours, args.rank, seed)
    registry = LoraRegistry(
        4, head_dim=config.attention_head_dim, check=lambda lora: check_targets(ours, lora), pin=device.type == "cuda"
    )
    start = time.perf_counter()
    names = [registry.register(path) for path in files]
    first_use_s = (time.perf_counter() - start) / len(files)
    adapters = [[(registry.adapter(name), 1.0)] for name in names]
    kwargs = inputs(rows, config, device) if not args.tiny else tiny_inputs(rows, config, device)
    time_ms = timer(device, warmup=2)
    out = {"first use s": first_use_s}
    with torch.no_grad():
        out["diffusers"] = time_ms(lambda: reference(**kwargs, return_dict=False), args.repeat)
        expected_plain = reference(**kwargs, return_dict=False)[0]
        set_quality(ours, "lossless")
        fast = copy.deepcopy(ours)
        set_quality(fast, "fast")

        def tier_variants(model, outside: str) -> dict:
            """name -> setup() that sets `model`'s adapters and returns its step (its AdaLN tables made after the
            adapters are set: LoRA on the AdaLN projections changes them)."""

            def setup(inside_gemm=None):
                if inside_gemm is None:
                    deactivate(model)
                else:
                    activate(model, adapters[0], "t2va", device, inside_gemm=inside_gemm)
                tables = model.precompute_adaln([kwargs["timestep"]])
                return lambda: model(**kwargs, return_dict=False, adaln_tables=tables, step=0)

            tier = model.quality
            return {tier: setup, f"{tier}+lora": lambda: setup(True), outside: lambda: setup(False)}

        lossless = tier_variants(ours, "lossless+lora, update outside the GEMM")
        fast_variants = tier_variants(fast, "fast+lora, update after the GEMM")
        # Every variant timed once per round, in turn, so that a drift of the clocks over the run (the GPU warms
        # up) reaches all of them alike, every other round in the reverse order, so that no variant is always
        # timed after another; the median over the rounds is kept.
        rounds = {name: [] for name in (*lossless, *fast_variants)}
        order = [*lossless.items(), *fast_variants.items()]
        for index in range(args.rounds):
            for name, setup in order if index % 2 == 0 else order[::-1]:
                rounds[name].append(time_ms(setup(), args.repeat))
        out.update({name: statistics.median(times) for name, times in rounds.items()})
        out["rounds"] = rounds
        step = lossless["lossless"]()
        got_plain = step()[0]
        out["peak lossless"] = peak_bytes(step, device)
        if args.profile:
            out["kernels lossless"] = kernel_us(step, device)
        step = lossless["lossless+lora"]()
        got_lora = step()[0]
        out["peak lossless+lora"] = peak_bytes(step, device)
        if args.profile:
            out["kernels lossless+lora"] = kernel_us(step, device)
        out["adapter bytes"] = ours.active_loras.nbytes
        out["lossless groups inside their GEMMs"] = sum(
            any(m.wide_weight is not None for m in g.members) for g in ours.active_loras.groups
        )
        lossless_outside = lossless["lossless+lora, update outside the GEMM"]()()[0]
        # Switching between two registered adapters, as consecutive requests with different sets do.
        switches = []
        for i in range(4):
            synchronize(device)
            start = time.perf_counter()
            activate(ours, adapters[(i + 1) % 2], "t2va", device)
            synchronize(device)
            switches.append(time.perf_counter() - start)
        out["switch s"] = statistics.median(switches)
        deactivate(ours)
        step = fast_variants["fast"]()
        fast_plain = step()[0]
        if args.profile:
            out["kernels fast"] = kernel_us(step, device)
        step = fast_variants["fast+lora"]()
        fast_lora = step()[0]
        if args.profile:
            out["kernels fast+lora"] = kernel_us(step, device)
        out["fast groups inside their GEMMs"] = sum(g.wide for g in fast.active_loras.groups)
        fast_after = fast_variants["fast+lora, update after the GEMM"]()()[0]
        del fast, fast_variants, step
        diffusers_with_lora(reference, files[0])
        out["diffusers+peft"] = time_ms(lambda: reference(**kwargs, return_dict=False), args.repeat)
        expected_lora = reference(**kwargs, return_dict=False)[0]
    out["relL2 lossless+lora vs diffusers+peft"] = rel_l2(got_lora, expected_lora)
    out["relL2 adapter change"] = rel_l2(expected_lora, expected_plain)
    out["relL2 of the change, ours vs diffusers"] = rel_l2(got_lora - got_plain, expected_lora - expected_plain)
    out["relL2 of the change, ours (outside) vs diffusers"] = rel_l2(
        lossless_outside - got_plain, expected_lora - expected_plain
    )
    out["relL2 of the change, fast vs diffusers"] = rel_l2(fast_lora - fast_plain, expected_lora - expected_plain)
    out["relL2 of the change, fast (after) vs diffusers"] = rel_l2(
        fast_after - fast_plain, expected_lora - expected_plain
    )
    reference = ours = None  # the closures above hold them: free both before the cache is emptied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def tiny_inputs(rows: int, config: H3TransformerConfig, device):
    """A small t2va layout for `--tiny` (any `rows` above the text and audio rows)."""
    from h3gen.pipelines.h3.packing import build_layout, row_timesteps

    frames = max(1, (rows - 16 - 2 * 7) // 16)
    layout = build_layout(16, frames, 8, 8, 7)
    timestep, indices = row_timesteps(layout, 0.37, 0.61, 0.999)
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g).to(device),
        audio_hidden_states=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g).to(
            device
        ),
        encoder_hidden_states=torch.randn(1, 16, config.text_dim, generator=g).to(device),
        timestep=timestep.to(device),
        timestep_indices=indices.to(device),
        token_tags=layout.token_tags.to(device),
        position_ids=layout.position_ids.to(device),
        video_indices=layout.video_indices.to(device),
        audio_indices=layout.audio_indices.to(device),
        text_indices=layout.text_indices.to(device),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--layers", type=int, default=4, help="full-size blocks measured (the step is extrapolated to 50)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[37838, 8192])
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="time our variants this many times each, in turn, "
        "every other round in reverse (the median of the "
        "rounds is kept)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (checks the script runs)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also list, per row count and tier, the CUDA kernels whose time the adapters change most "
        "(torch.profiler, the measured-blocks step with minus without)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.tiny:
        print("--tiny: tiny dims on the CPU; the timings below only show the script runs end to end.")
        device, dtype = torch.device("cpu"), torch.float32
        args.layers, args.rank, args.repeat = 2, 8, 2
        args.rows = [r for r in args.rows if r <= 600] or [300]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    variants = (
        "diffusers",
        "diffusers+peft",
        "lossless",
        "lossless+lora",
        "lossless+lora, update outside the GEMM",
        "fast",
        "fast+lora",
        "fast+lora, update after the GEMM",
    )
    table, raw, kernels = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for rows in args.rows:
            empty = measure(0, rows, args, device, dtype, Path(folder))
            full = measure(args.layers, rows, args, device, dtype, Path(folder))
            raw.append({"rows": rows, "layers": args.layers, "0 layers": empty, "measured": full})
            step50 = {v: empty[v] + 50 * (full[v] - empty[v]) / args.layers for v in variants}
            per_block_bytes = (full["adapter bytes"] - empty["adapter bytes"]) / args.layers
            for v in variants:
                plain = v.split("+")[0]
                table.append(
                    {
                        "rows": rows,
                        "variant": v,
                        f"{args.layers}-block ms": f"{full[v]:.2f}",
                        "each round": " ".join(f"{t:.1f}" for t in full["rounds"].get(v, [])),
                        "50-block step s": f"{step50[v] / 1000:.3f}",
                        "vs no LoRA": f"{step50[v] / step50[plain]:.3f}" if v != plain else "",
                    }
                )
            print(
                f"rows {rows}: LoRA overhead on the 50-block step: lossless "
                f"{100 * (step50['lossless+lora'] / step50['lossless'] - 1):+.1f} % (goal <= 4 %; with the update "
                f"written before its GEMMs "
                f"{100 * (step50['lossless+lora, update outside the GEMM'] / step50['lossless'] - 1):+.1f} %), fast "
                f"{100 * (step50['fast+lora'] / step50['fast'] - 1):+.1f} % (goal <= 6 %; with the update after its "
                f"GEMMs {100 * (step50['fast+lora, update after the GEMM'] / step50['fast'] - 1):+.1f} %), "
                f"diffusers PEFT "
                f"{100 * (step50['diffusers+peft'] / step50['diffusers'] - 1):+.1f} %; lossless+lora is "
                f"{step50['diffusers+peft'] / step50['lossless+lora']:.2f}x diffusers+peft"
            )
            per_round = [
                100 * ((e1 + 50 * (f1 - e1) / args.layers) / (e0 + 50 * (f0 - e0) / args.layers) - 1)
                for e0, e1, f0, f1 in zip(
                    empty["rounds"]["lossless"],
                    empty["rounds"]["lossless+lora"],
                    full["rounds"]["lossless"],
                    full["rounds"]["lossless+lora"],
                    strict=False,
                )
            ]
            print(
                f"rows {rows}: the lossless overhead from each round's own times: "
                + ", ".join(f"{p:+.1f} %" for p in per_round)
            )
            print(
                f"rows {rows}: switching adapter sets {full['switch s'] * 1000:.0f} ms for {args.layers} blocks "
                f"(50 blocks: ~{(empty['switch s'] + 50 * (full['switch s'] - empty['switch s']) / args.layers):.2f}"
                f" s, goal <= 0.5 s); first use of a file {full['first use s']:.2f} s; adapter on the device "
                f"{(empty['adapter bytes'] + 50 * per_block_bytes) / 2**30:.2f} GiB for 50 blocks; relL2 vs "
                f"diffusers+peft {full['relL2 lossless+lora vs diffusers+peft']:.2e} (the adapter moves the output "
                f"by {full['relL2 adapter change']:.2e}; that change in ours vs in diffusers: relL2 "
                f"{full['relL2 of the change, ours vs diffusers']:.2e}, with the update outside its GEMMs "
                f"{full['relL2 of the change, ours (outside) vs diffusers']:.2e}; in the fast tier "
                f"{full['relL2 of the change, fast vs diffusers']:.2e}, with the update after its GEMMs "
                f"{full['relL2 of the change, fast (after) vs diffusers']:.2e}); LoRA groups inside their GEMMs: "
                f"lossless {full['lossless groups inside their GEMMs']}, "
                f"fast {full['fast groups inside their GEMMs']}"
            )
            if args.profile and device.type == "cuda":
                # The 0-block model's step is bound by kernel launches (its wall time varies by milliseconds
                # between runs), which the 50-block estimate multiplies; summed kernel time does not vary so.
                busy = {
                    v: kernel_step_ms(empty[f"kernels {v}"], full[f"kernels {v}"], args.layers)
                    for v in ("lossless", "lossless+lora", "fast", "fast+lora")
                }
                print(
                    f"rows {rows}: GPU kernel time of the 50-block step: lossless {busy['lossless']:.1f} ms, "
                    f"{100 * (busy['lossless+lora'] / busy['lossless'] - 1):+.1f} % with the adapter; fast "
                    f"{busy['fast']:.1f} ms, {100 * (busy['fast+lora'] / busy['fast'] - 1):+.1f} %"
                )
                for tier in ("lossless", "fast"):
                    kernels += kernel_delta_rows(rows, tier, full[f"kernels {tier}"], full[f"kernels {tier}+lora"])
            if full["peak lossless"] is not None:
                print(
                    f"rows {rows}: peak memory of the {args.layers}-block step {full['peak lossless'] / 2**30:.2f}"
                    f" GiB without the adapter, {full['peak lossless+lora'] / 2**30:.2f} GiB with it"
                )
    if args.out:
        args.out.write_text(json.dumps(raw, indent=2, default=str))
    if kernels:
        print(f"\nCUDA kernel time per {args.layers}-block step, with the adapter minus without:")
        print_table(kernels, ["rows", "tier", "kernel", "us without", "us with", "delta us"])
        print()
    print_table(table, ["rows", "variant", f"{args.layers}-block ms", "each round", "50-block step s", "vs no LoRA"])


if __name__ == "__main__":
    main()
