"""MXFP4-weight GEMM (our Triton kernels) against bf16 cuBLAS at MiniMax-H3's GEMM shapes (K x N: 5376x7168,
7168x5376, 5376x28672, 14336x5376) for M in {1, 8, 16, 256, 4096, 37838}, in one process on the same inputs; then
one full-size block with MXFP4 linears against bf16 (error, time, weight bytes per block).

Timing rotates over enough copies of each weight that none is served from the 60 MB L2 cache, and runs many calls
between two CUDA events, so small-M figures are memory-bound kernel time rather than one launch's latency. Prints
per shape and M: time, TFLOP/s, bandwidth on the packed weight bytes (and its share of the measured copy
bandwidth), speedup over bf16, error against the bf16 product of the dequantized weight.

    python benchmarks/bench_mxfp4.py              # the table with the shipped dispatch
    python benchmarks/bench_mxfp4.py --sweep      # also try tile configurations per shape and M, print the best
                                                  # (GPU time of graphed calls up to 256 rows)
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2

from h3gen.kernels.mxfp4_gemm import (
    gluon,
    triton_decode,
    triton_fused,
    triton_gemv,
    triton_grid,
    triton_pairs,
    triton_scaled,
)
from h3gen.kernels.mxfp4_gemm import triton as mxfp4
from h3gen.quant.mxfp4_format import dequantize, quantize

SHAPES = [(5376, 7168), (7168, 5376), (5376, 28672), (14336, 5376)]
ROWS = [1, 8, 16, 256, 4096, 37838]
L2_FLUSH_BYTES = 240e6  # rotate over at least this many weight bytes (4x the H200's L2)


def time_rotating(fn, arg_sets, *, calls: int | None = None, repeat: int = 5, graph: bool = False) -> float:
    """Median milliseconds per `fn(*args)` call, cycling through `arg_sets` (distinct weight copies) so each call
    reads its weight from HBM; `calls` calls are timed between two events. `graph`: the calls are captured once in
    a CUDA graph and replayed, which leaves out the host's launch cost (the GPU time alone)."""
    calls = calls or max(len(arg_sets), 20)
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for i in range(calls):
                fn(*arg_sets[i % len(arg_sets)])
        captured.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            captured.replay()
        else:
            for i in range(calls):
                fn(*arg_sets[i % len(arg_sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy rate in GB/s, bytes read plus written."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_rotating(lambda: dst.copy_(src), [()], calls=10)
    return 2 * src.numel() / ms / 1e6


def weight_copies(k, n, nbytes):
    copies = max(2, math.ceil(L2_FLUSH_BYTES / nbytes))
    weights = []
    for _ in range(copies):
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        packed, scales = quantize(weight)
        weights.append((weight, packed, scales))
    return weights


def small_m_configs(m):
    if m == 1:
        for block_n in (16, 32):
            for block_k in (512, 1024, 2048):
                for num_warps in (4, 8):
                    yield dict(path="gemv", block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3)
    for block_n in (64, 128):
        for block_k in (256, 512):
            for num_stages in (3, 5):
                yield dict(
                    block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=num_stages, split="auto"
                )


def pair_configs(m):
    """Tiles for the tensor-core few-row path (`pair_matmul`, bf16): K slices fill the GPU at narrow N."""
    if 1 < m <= 16:
        for block_n in (32, 64, 128, 256):
            for block_k in (128, 256):
                for num_stages in (2, 3, 4):
                    for split in (1, 2, 4):
                        for num_warps in (1, 2, 4) if block_n <= 64 else (4, 8):
                            yield dict(
                                path="pairs",
                                block_n=block_n,
                                block_k=block_k,
                                num_warps=num_warps,
                                num_stages=num_stages,
                                split=split,
                            )


def few_rows_configs(m):
    """Tiles for the Gluon few-row path (`gluon.few_rows_matmul`, bf16): rows of W per program, warps, and K slices
    (None: `gluon.plan`'s choice)."""
    if m <= 16:
        for block_n, warps in ((32, 2), (64, 2), (64, 4), (128, 4)):
            for splits in (None, 1, 2, 3, 6, 7, 14):
                yield dict(path="few_rows", block_n=block_n, warps=warps, splits=splits)


def scaled_configs(m):
    """Tiles for the `tl.dot_scaled` path: the rows are the MMA's narrow side, so the row tile follows M."""
    small = m <= 16
    for block_m in (16,) if small else (32, 64) if m <= 256 else (64, 128):
        for block_n in (32, 64, 128) if small else (64, 128):
            for block_k in (128, 256, 512) if small else (128, 256):
                yield dict(
                    path="scaled",
                    block_m=block_m,
                    block_n=block_n,
                    block_k=block_k,
                    num_warps=4 if block_m * block_n <= 64 * 64 else 8,
                    num_stages=3,
                    split="auto" if m <= 256 else 1,
                )


DEQUANT_CONFIGS = [
    dict(block_n=bn, block_k=bk, num_warps=w)
    for bn, bk, w in [(32, 256, 4), (64, 256, 4), (16, 512, 4), (64, 128, 4), (32, 512, 8), (128, 256, 8)]
]


def sweep_dequantize(log):
    """The dequantize kernel alone on the largest weight: GB/s moved (packed read + bf16 written)."""
    rows = []
    for k, n in SHAPES[2:3]:
        weights = weight_copies(k, n, n * k // 2)
        nbytes = n * k // 2 + n * k // 32 + 2 * n * k
        for config in DEQUANT_CONFIGS:
            ms = time_rotating(
                lambda p, s, c=config: triton_decode.dequantize(p, s, torch.bfloat16, k, **c),
                [(p, s) for _, p, s in weights],
                repeat=3,
            )
            rows.append(
                {"K x N": f"{k}x{n}", "config": str(config), "ms": f"{ms:.4f}", "GB/s": f"{nbytes / ms / 1e6:.0f}"}
            )
            log.write(f"dequantize {rows[-1]}\n")
    return rows


def run_config(x, packed, scales, config):
    config = dict(config)
    path = config.pop("path", "fused")
    if path == "gemv":
        return triton_gemv.gemv(x, packed, scales, **config)
    if path == "few_rows":  # K slices must divide K's steps: others raise and the sweep skips them
        return gluon.few_rows_matmul(x, packed, scales, **config)
    split = config.pop("split")
    if split == "auto":
        split = triton_grid.auto_split(packed.shape[0], x.shape[1], config["block_n"], config["block_k"])
    if path == "scaled":
        return triton_scaled.scaled_matmul(x, packed, scales, split_k=split, **config)
    if path == "pairs":
        return triton_pairs.pair_matmul(x, packed, scales, split_k=split, **config)
    return triton_fused.fused_matmul(x, packed, scales, split_k=split, **config)


def sweep(rows_list, log, budget_s, paths=("few_rows", "gemv", "pairs", "fused", "scaled")):
    """Best fused configuration per (shape, M) and the dequantize + cuBLAS time, against bf16; stops starting new
    shapes after `budget_s` seconds."""
    import time

    began = time.monotonic()
    best_rows = []
    for k, n in SHAPES:
        if time.monotonic() - began > budget_s:
            log.write(f"sweep budget spent; {k}x{n} skipped\n")
            continue
        weights = weight_copies(k, n, n * k // 2)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sets = [(x, p, s) for _, p, s in weights]
            graph = m <= 256  # GPU time: at a few rows the host's launch cost would hide the kernels
            bf16_ms = time_rotating(lambda x, w: x @ w.t(), [(x, w) for w, _, _ in weights], repeat=3, graph=graph)
            configs = list(small_m_configs(m)) if m <= 16 else []
            configs = [
                c
                for c in configs + list(scaled_configs(m)) + list(pair_configs(m)) + list(few_rows_configs(m))
                if c.get("path", "fused") in paths
            ]
            results = []
            for config in configs:
                try:
                    ms = time_rotating(
                        lambda x, p, s, c=config: run_config(x, p, s, c),
                        sets,
                        repeat=3,
                        calls=None if m < 4096 else 3,
                        graph=graph,
                    )
                except Exception as error:  # out of shared memory and the like: skip the configuration
                    log.write(f"{k}x{n} M={m} {config}: {type(error).__name__}: {str(error)[:200]}\n")
                    continue
                results.append((ms, config))
                log.write(f"{k}x{n} M={m} {config}: {ms:.4f} ms (bf16 {bf16_ms:.4f})\n")
            dequant_ms = time_rotating(
                lambda x, p, s: mxfp4.mxfp4_matmul(x, p, s, path="dequant"),
                sets,
                repeat=3,
                calls=None if m < 4096 else 3,
                graph=graph,
            )
            ms, config = min(results, key=lambda r: r[0]) if results else (float("nan"), None)
            best_rows.append(
                {
                    "K x N": f"{k}x{n}",
                    "M": m,
                    "bf16 ms": f"{bf16_ms:.4f}",
                    "best fused ms": f"{ms:.4f}",
                    "x bf16": f"{bf16_ms / ms:.2f}",
                    "dequant+cuBLAS ms": f"{dequant_ms:.4f}",
                    "x bf16 (dequant)": f"{bf16_ms / dequant_ms:.2f}",
                    "config": str(config),
                }
            )
            log.flush()
        del weights
        torch.cuda.empty_cache()
    return best_rows


def bench_gemms(rows_list, copy_gbs):
    table = []
    for k, n in SHAPES:
        packed_bytes = n * k // 2 + n * k // 32
        weights = weight_copies(k, n, packed_bytes)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weight, packed, scales = weights[0]
            expected = x @ dequantize(packed, scales, torch.bfloat16).t()
            got = mxfp4.mxfp4_matmul(x, packed, scales)
            calls = None if m < 4096 else 3
            bf16_ms = time_rotating(lambda x, w: x @ w.t(), [(x, w) for w, _, _ in weights], calls=calls)
            ours_ms = time_rotating(mxfp4.mxfp4_matmul, [(x, p, s) for _, p, s in weights], calls=calls)
            graph_ms = bf16_graph_ms = float("nan")
            if m <= 256:  # where launch cost can hide the kernel
                graph_ms = time_rotating(mxfp4.mxfp4_matmul, [(x, p, s) for _, p, s in weights], graph=True)
                bf16_graph_ms = time_rotating(lambda x, w: x @ w.t(), [(x, w) for w, _, _ in weights], graph=True)
            registers_ms = float("nan")
            if gluon.supports(x, packed, scales) and gluon.uses_ring(packed):  # the kernel before the TMA ring
                registers_ms = time_rotating(
                    lambda x, p, s: gluon.few_rows_matmul(x, p, s, ring=False, fold=False),
                    [(x, p, s) for _, p, s in weights],
                    graph=True,
                )
            flops = 2 * m * n * k
            table.append(
                {
                    "K x N": f"{k}x{n}",
                    "M": m,
                    "bf16 ms": f"{bf16_ms:.4f}",
                    "mxfp4 ms": f"{ours_ms:.4f}",
                    "mxfp4 TFLOP/s": f"{flops / ours_ms / 1e9:.0f}",
                    "packed GB/s": f"{packed_bytes / ours_ms / 1e6:.0f}",
                    "% copy BW": f"{100 * packed_bytes / ours_ms / 1e6 / copy_gbs:.0f}",
                    "x bf16": f"{bf16_ms / ours_ms:.2f}",
                    "relL2": f"{rel_l2(got, expected):.1e}",
                    "graphed: bf16 ms": f"{bf16_graph_ms:.4f}",
                    "graphed mxfp4 ms": f"{graph_ms:.4f}",
                    "x bf16 (graphed)": f"{bf16_graph_ms / graph_ms:.2f}",
                    "% copy BW (graphed)": f"{100 * packed_bytes / graph_ms / 1e6 / copy_gbs:.0f}",
                    "graphed: registers, unfolded ms": f"{registers_ms:.4f}",
                    "x registers": f"{registers_ms / graph_ms:.2f}",
                }
            )
            print(table[-1], flush=True)
        del weights
        torch.cuda.empty_cache()
    return table


def bench_block(rows, repeat):
    """One full-size block: MXFP4 linears (q/k/v/out, SwiGLU, AdaLN) against bf16; error, time, weight bytes."""
    from bench_h3_block import CFG, make_inputs
    from common import time_cuda

    from h3gen.linear import dense_linear, make_linear_factory
    from h3gen.pipelines.h3.tiers import fused_block_forward
    from h3gen.pipelines.h3.transformer_blocks import H3TransformerBlock

    torch.manual_seed(0)
    dense = H3TransformerBlock(CFG, dense_linear).to("cuda", torch.bfloat16).eval()
    quantized = H3TransformerBlock(CFG, make_linear_factory(quantization="mxfp4")).to("cuda").eval()
    for name, module in quantized.named_modules():
        if hasattr(module, "set_weight"):
            module.set_weight(dense.get_submodule(name).weight)
            module.compute_dtype = torch.bfloat16
            if module.bias is not None:
                module.bias = torch.nn.Parameter(dense.get_submodule(name).bias.detach().clone())
    for name, param in quantized.named_parameters():
        if "norm" in name:
            param.data = dense.get_parameter(name).data.clone()
    x, temb, idx, rope = make_inputs(rows, "cuda")
    table = []
    with torch.no_grad():
        outputs = {}
        for label, block in (("bf16", dense), ("mxfp4", quantized)):
            block.fused_forward, block.attn.core.backend = fused_block_forward, "auto"
            outputs[label] = block(x.clone(), temb, idx, rope)
            ms = time_cuda(lambda b=block: b(x.clone(), temb, idx, rope), repeat=repeat)
            nbytes = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
            table.append({"block": f"{label}, {rows} rows", "ms": f"{ms:.2f}", "weight GB": f"{nbytes / 1e9:.3f}"})
    table[1]["relL2 vs bf16"] = f"{rel_l2(outputs['mxfp4'], outputs['bf16']):.2e}"
    del dense, quantized
    torch.cuda.empty_cache()
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--block-rows", type=int, nargs="*", default=[8192])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-budget", type=float, default=240.0, help="seconds of GEMM sweeping at most")
    parser.add_argument(
        "--sweep-paths",
        nargs="+",
        default=["few_rows", "gemv", "pairs", "fused", "scaled"],
        help="kernel paths the sweep tries",
    )
    parser.add_argument("--out", type=Path, help="folder for the JSON results and the sweep log")
    args = parser.parse_args()
    out = args.out or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    if args.sweep:
        with open(out / "mxfp4_sweep.log", "w") as log:
            results["dequantize"] = sweep_dequantize(log)
            print_table(results["dequantize"], ["K x N", "config", "ms", "GB/s"])
            results["sweep"] = sweep(args.rows, log, args.sweep_budget, args.sweep_paths)
            print_table(
                results["sweep"],
                ["K x N", "M", "bf16 ms", "best fused ms", "x bf16", "dequant+cuBLAS ms", "x bf16 (dequant)", "config"],
            )
    results["gemm"] = bench_gemms(args.rows, copy_gbs)
    results["block"] = [row for rows in args.block_rows for row in bench_block(rows, args.repeat)]
    (out / "bench_mxfp4.json").write_text(json.dumps(results, indent=2))
    if results["block"]:
        print()
        print_table(results["block"], ["block", "ms", "weight GB", "relL2 vs bf16"])
    if args.sweep:
        print()
        print_table(
            results["sweep"],
            ["K x N", "M", "bf16 ms", "best fused ms", "x bf16", "dequant+cuBLAS ms", "x bf16 (dequant)", "config"],
        )
    print()
    print_table(
        results["gemm"],
        [
            "K x N",
            "M",
            "bf16 ms",
            "mxfp4 ms",
            "mxfp4 TFLOP/s",
            "packed GB/s",
            "% copy BW",
            "x bf16",
            "relL2",
            "graphed: bf16 ms",
            "graphed mxfp4 ms",
            "x bf16 (graphed)",
            "% copy BW (graphed)",
            "graphed: registers, unfolded ms",
            "x registers",
        ],
    )


if __name__ == "__main__":
    main()
