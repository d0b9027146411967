"""One MiniMax-H3 transformer block at released dims: diffusers 0.42.1 (eager, cuDNN SDPA, torch.compile) against
ours (exact, lossless, fast) on the same weights and inputs, over the packed sequence of a 5 s 768x1344 request
(37,838 rows) and of a short clip (8,192 rows).

Prints, per variant: median time, TFLOP/s, % of the measured bf16 matmul peak, ratios to eager and compiled
diffusers, and the error against eager diffusers; then a breakdown of the parts (attention backends and layouts,
GEMMs, fused kernels). Full numbers go to `--out` as JSON.

The H200 runs this block under its power cap (clocks drop part of the time, a spread of about ±3 % between passes
of the same code); `--rounds N` times every variant once per round, N rounds interleaved, and reports medians and
the median of the per-round ratios to compiled diffusers.

    python benchmarks/bench_h3_block.py --rows 8192 37838 --out block.json
    python benchmarks/bench_h3_block.py --rows 8192 --no-parts --rounds 7
"""

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import matmul_peak_tflops, print_table, rel_l2, time_cuda

from h3gen.linear import dense_linear
from h3gen.pipelines.h3.packing import build_layout, row_timesteps
from h3gen.pipelines.h3.tiers import fast_block_forward, fused_block_forward, quantize_block_linears
from h3gen.pipelines.h3.transformer_blocks import H3RotaryPosEmbed, H3TransformerBlock
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

CFG = H3TransformerConfig()  # released dims
HIDDEN, HEADS, HEAD_DIM, FFN = CFG.hidden_size, CFG.num_attention_heads, CFG.attention_head_dim, CFG.ffn_dim


def block_flops(rows: int) -> float:
    linear = 2 * rows * (4 * HIDDEN * HEADS * HEAD_DIM + 3 * HIDDEN * FFN)
    attention = 4 * rows * rows * HEADS * HEAD_DIM
    return linear + attention


def make_inputs(rows: int, device, config: H3TransformerConfig = CFG, dtype: torch.dtype = torch.bfloat16):
    """A real 5 s 768x1344 t2va layout (128 text rows), truncated to `rows`; two distinct timesteps. `config` sets
    the widths (released by default)."""
    layout = build_layout(128, 37, 48, 84, 207)
    timestep, indices = row_timesteps(layout, 0.37, 0.61, 0.999)
    positions = layout.position_ids[:rows].to(device)
    adaln_indices = (indices * 3 + layout.token_tags)[:rows].to(device)
    cos, sin = H3RotaryPosEmbed(config.rope_freq_dim, config.rope_theta).to(device)(positions)
    generator = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(1, rows, config.hidden_size, device=device, dtype=dtype, generator=generator)
    temb = torch.randn(timestep.numel(), config.time_embed_dim, device=device, generator=generator)
    return x, temb, adaln_indices, (cos, sin)


def build_blocks(device):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    torch.manual_seed(0)
    reference = MiniMaxH3TransformerBlock(
        HIDDEN, HEADS, HEAD_DIM, FFN, CFG.time_embed_dim, CFG.norm_eps, CFG.qk_norm_eps
    )
    with torch.no_grad():  # give the norms non-trivial weights too
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    reference = reference.to(device, torch.bfloat16).eval()
    ours = H3TransformerBlock(CFG, dense_linear).to(device, torch.bfloat16).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


BACK_TO_BACK = 1  # blocks run per timed sample (--back-to-back): a step runs its 50 blocks back to back


def timed(fn, x, args, repeat):
    """Median ms per call of `fn(x_copy, *args)`, `BACK_TO_BACK` calls per timed sample (one call leaves the GPU
    idle while the first kernels launch, which a step's 50 blocks in a row never do); the residual stream is
    restored before every sample (outside the timing), since the fused block updates it in place."""
    work = x.clone()

    def run():
        for _ in range(BACK_TO_BACK):
            fn(work, *args)

    def setup():
        work.copy_(x)

    return time_cuda(run, warmup=3, repeat=repeat, setup=setup) / BACK_TO_BACK


def graphed(fn, x, args):
    """`fn` captured once in a CUDA graph on a static copy of `x`; returns a callable with `fn`'s signature that
    copies its input in and replays (what a step-level graph would save: the launches between kernels)."""
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(static.clone(), *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static, *args)

    def replay(h, *_):
        static.copy_(h)
        graph.replay()
        return out

    return replay


def _ours(model, forward, backend, extra):
    """A call of our block in one configuration (set on every call, so that configurations can be interleaved)."""

    def run(h, *a):
        model.fused_forward, model.attn.core.backend = forward, backend
        return model(h, *a, **extra)

    return run


def bench_rows(
    rows: int,
    reference,
    ours,
    fast,
    peak: float,
    device,
    repeat: int,
    compile_ref: bool,
    graph: bool = False,
    rounds: int = 1,
) -> list[dict]:
    """Every variant's median time over `rounds` interleaved rounds (each round times every variant once, so drift
    of the clocks under the power cap falls on all variants alike); "x compiled" is the median of the per-round
    ratios when `rounds` > 1."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3gen.kernels.attention import fa3_kernel

    fa3_available = fa3_kernel() is not None
    x, temb, idx, rope = make_inputs(rows, device)
    args = (temb, idx, rope)
    flops = block_flops(rows)
    calls = {}  # label -> (callable(h, *args), output)

    with torch.no_grad():
        expected = reference(x.clone(), *args)

        def eager(h, *a):
            return reference(h, *a)

        def eager_cudnn(h, *a):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return reference(h, *a)

        calls["diffusers eager"] = (eager, expected)
        calls["diffusers eager, cuDNN SDPA"] = (eager_cudnn, eager_cudnn(x.clone(), *args))
        if compile_ref:
            compiled = torch.compile(reference)
            calls["diffusers torch.compile"] = (lambda h, *a: compiled(h, *a), compiled(x.clone(), *args))
        exact = _ours(ours, None, "sdpa", {})
        calls["ours exact"] = (exact, exact(x.clone(), *args))
        # "AdaLN precomputed": the block gets its request-wide AdaLN table (what the lossless and fast tiers do
        # in the pipeline: one batched projection per block per request), so no AdaLN GEMM runs per step.
        table = ours.adaln_proj.table(temb)
        # (label, block, forward, attention backend, AdaLN table precomputed)
        variants = [
            ("ours lossless (cuDNN attention)", ours, fused_block_forward, "cudnn", False),
            ("ours lossless, AdaLN precomputed", ours, fused_block_forward, "cudnn", True),
            ("ours fast, FP8 GEMMs + cuDNN", fast, fast_block_forward, "cudnn", True),
        ]
        if fa3_available:
            variants += [
                ("ours lossless, FA3 attention", ours, fused_block_forward, "fa3", True),
                ("ours fast, FP8 + FA3 FP8, quantizing passes", fast, fused_block_forward, "fa3-fp8", True),
                ("ours fast, FP8 + FA3 FP8 (the tier)", fast, fast_block_forward, "fa3-fp8", True),
            ]
        for label, model, forward, backend, precomputed in variants:
            run = _ours(model, forward, backend, {"modulation": table} if precomputed else {})
            calls[label] = (run, run(x.clone(), *args))

        if fa3_available and graph:
            ours.fused_forward, ours.attn.core.backend = fused_block_forward, "fa3"
            try:
                replay = graphed(lambda h, *a: ours(h, *a, modulation=table), x, args)
                calls["ours lossless, FA3, CUDA graph"] = (replay, replay(x.clone(), *args).clone())
            except Exception as error:
                print(f"CUDA graph capture failed: {type(error).__name__}: {str(error)[:300]}", flush=True)

        if compile_ref:  # regional compile of our fused block (user-defined Triton kernels inside the graph)
            mine = copy.deepcopy(ours)  # its own module: the others switch configurations between calls
            mine.fused_forward, mine.attn.core.backend = fused_block_forward, "cudnn"
            try:
                compiled_ours = torch.compile(mine)
                calls["ours lossless + torch.compile"] = (
                    lambda h, *a: compiled_ours(h, *a),
                    compiled_ours(x.clone(), *args),
                )
            except Exception as error:  # reported, not fatal: compile support for Triton kernels varies
                print(f"torch.compile of our block failed: {type(error).__name__}: {str(error)[:300]}", flush=True)

        samples = {label: [] for label in calls}
        for _ in range(rounds):
            for label, (fn, _) in calls.items():
                samples[label].append(timed(fn, x, args, repeat))

    median = {label: statistics.median(times) for label, times in samples.items()}
    eager_ms = median["diffusers eager"]
    compiled_ms = median.get("diffusers torch.compile")

    def versus_compiled(label):
        ratios = [c / t for c, t in zip(samples["diffusers torch.compile"], samples[label], strict=False)]
        return statistics.median(ratios)

    table = []
    for name, (_, out) in calls.items():
        ms = median[name]
        table.append(
            {
                "rows": rows,
                "variant": name,
                "ms": f"{ms:.2f}",
                "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                "% peak": f"{100 * flops / ms / 1e9 / peak:.0f}",
                "x eager": f"{eager_ms / ms:.3f}",
                "x compiled": f"{versus_compiled(name):.3f}" if compiled_ms else "-",
                "ms min-max": f"{min(samples[name]):.2f}-{max(samples[name]):.2f}",
                "relL2 vs eager": f"{rel_l2(out, expected):.2e}",
                "maxabs vs eager": f"{(out.float() - expected.float()).abs().max().item():.2e}",
            }
        )
    return table


def bench_parts(rows: int, ours, device, repeat: int) -> list[dict]:
    """Where the time of one block goes: attention per backend/layout, each GEMM, each fused kernel."""
    from h3gen.kernels.attention import attention
    from h3gen.kernels.gated_residual import gated_residual_norm_modulate
    from h3gen.kernels.norm_modulate import rmsnorm_modulate
    from h3gen.kernels.qk_norm_rope import qk_norm_rope
    from h3gen.kernels.swiglu import swiglu

    x, temb, idx, (cos, sin) = make_inputs(rows, device)
    table = []

    def add(name, ms, flops=None, nbytes=None):
        row = {"rows": rows, "part": name, "ms": f"{ms:.3f}"}
        if flops:
            row["TFLOP/s"] = f"{flops / ms / 1e9:.0f}"
        if nbytes:
            row["GB/s"] = f"{nbytes / ms / 1e6:.0f}"
        table.append(row)

    with torch.no_grad():
        qkv = [torch.randn(1, rows, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(3)]
        heads_first = [t.transpose(1, 2).contiguous() for t in qkv]
        attn_flops = 4 * rows * rows * HEADS * HEAD_DIM
        for backend in ("cudnn", "flash", "fa3"):
            try:
                add(
                    f"attention {backend} bshd",
                    time_cuda(lambda: attention(*qkv, backend=backend), repeat=repeat),
                    attn_flops,
                )
                add(
                    f"attention {backend} bhsd",
                    time_cuda(lambda: attention(*heads_first, backend=backend, layout="bhsd"), repeat=repeat),
                    attn_flops,
                )
            except (RuntimeError, ValueError) as error:
                table.append({"rows": rows, "part": f"attention {backend}", "ms": f"n/a ({str(error)[:40]})"})
        for name, layer in (
            ("to_q", ours.attn.to_q),
            ("to_out", ours.attn.to_out[0]),
            ("ff up", ours.ff.net[0].proj),
            ("ff down", ours.ff.net[2]),
        ):
            inp = torch.randn(1, rows, layer.in_features, device=device, dtype=torch.bfloat16)
            add(
                f"gemm {name}",
                time_cuda(lambda: layer(inp), repeat=repeat),
                2 * rows * layer.in_features * layer.out_features,
            )
        table_rows = ours.adaln_proj(temb)
        row_bytes = rows * HIDDEN * 2
        add(
            "rmsnorm_modulate",
            time_cuda(
                lambda: rmsnorm_modulate(x, ours.norm1.weight, table_rows[0], table_rows[1], idx, 1e-5), repeat=repeat
            ),
            nbytes=2 * row_bytes,
        )
        y = torch.randn_like(x)
        add(
            "gated_residual_norm_modulate",
            time_cuda(
                lambda: gated_residual_norm_modulate(
                    x, y, table_rows[2], idx, ours.norm2.weight, table_rows[3], table_rows[4], 1e-5
                ),
                repeat=repeat,
            ),
            nbytes=4 * row_bytes,
        )
        q, k = qkv[0], qkv[1]
        qk_bytes = 4 * rows * HEADS * HEAD_DIM * 2
        add(
            "qk_norm_rope bshd",
            time_cuda(
                lambda: qk_norm_rope(q, k, ours.attn.norm_q.weight, ours.attn.norm_k.weight, cos, sin, 1e-5),
                repeat=repeat,
            ),
            nbytes=qk_bytes,
        )
        add(
            "qk_norm_rope bhsd",
            time_cuda(
                lambda: qk_norm_rope(
                    q, k, ours.attn.norm_q.weight, ours.attn.norm_k.weight, cos, sin, 1e-5, heads_first=True
                ),
                repeat=repeat,
            ),
            nbytes=qk_bytes,
        )
        up = torch.randn(1, rows, 2 * FFN, device=device, dtype=torch.bfloat16)
        add("swiglu", time_cuda(lambda: swiglu(up), repeat=repeat), nbytes=3 * rows * FFN * 2)
        add("adaln_proj (K=2)", time_cuda(lambda: ours.adaln_proj(temb), repeat=repeat))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 37838])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of diffusers' block")
    parser.add_argument("--no-parts", action="store_true")
    parser.add_argument("--graph", action="store_true", help="also time our lossless block replayed as a CUDA graph")
    parser.add_argument(
        "--back-to-back",
        type=int,
        default=1,
        help="blocks run back to back per timed sample (as in a step), time reported per block",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleaved rounds per variant (medians; ratios to compiled diffusers per round)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global BACK_TO_BACK
    BACK_TO_BACK = args.back_to_back
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    peak = matmul_peak_tflops()
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 matmul peak {peak:.0f} TFLOP/s",
        flush=True,
    )
    reference, ours = build_blocks(device)
    fast = copy.deepcopy(ours)
    quantize_block_linears(fast)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_tflops": peak,
        "blocks": [],
        "parts": [],
    }
    for rows in args.rows:
        report["blocks"] += bench_rows(
            rows, reference, ours, fast, peak, device, args.repeat, not args.no_compile, args.graph, args.rounds
        )
        if not args.no_parts:
            report["parts"] += bench_parts(rows, ours, device, args.repeat)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    if report["parts"]:
        print()
        print_table(report["parts"], ["rows", "part", "ms", "TFLOP/s", "GB/s"])
    print()
    print_table(
        report["blocks"],
        [
            "rows",
            "variant",
            "ms",
            "TFLOP/s",
            "% peak",
            "x eager",
            "x compiled",
            "ms min-max",
            "relL2 vs eager",
            "maxabs vs eager",
        ],
    )


if __name__ == "__main__":
    main()
