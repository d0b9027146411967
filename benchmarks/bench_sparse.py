"""VSA-H3 sparse attention against dense attention on the same q/k/v, at the packed sequence of a 5 s 768x1344
t2va request: 128 text rows, 414 audio rows (207 latents per channel), video grid (37, 24, 42) = 37,296 rows,
37,838 in all (the layout `bench_h3_block.py` builds), 56 heads of 128 in bf16.

Section `op`: first the sparse op against its torch reference on a smaller shape, then at the full shape: dense
attention through the dispatch ("auto": FlashAttention-3 where installed, else cuDNN or flash; the table names it),
the tile selection alone, the op at `--sparsity` without and with the compression gate, the block-sparse kernel alone
under each launch setting of `triton.CONFIGS` (over bf16 and over e4m3 key tiles), then its reads and its math each
alone (`sparse_floors.py`, on a GPU), then the fast tier's: FA3's FP8 dense attention and the op over e4m3 key
tiles. Prints a table, then the dense/sparse ratios. `--tiny` runs small shapes on the CPU (the kernel under the Triton
interpreter), to show that the script works end to end.

Section `block`: one transformer block at released dims over the same rows, the base block dense and sparse and a
VSA student's block (with its gate) sparse, in the lossless and fast tiers (each with its tier's attention: FA3 where
installed, FA3's FP8 and the FP8 sparse kernel in the fast tier; there the student also over bf16 key tiles).
Section `forward`: the whole 50-block transformer (a student's, 70 GB in bf16) per forward: dense, the base model
at 0.75, the student at `--sparsity` (lossless), and the student in the fast tier (FP8 key tiles, then bf16). A
whole request end to end is `bench_pipeline.py` (`--profile fasth3`, and `--sparsity` for the base model).

    python benchmarks/bench_sparse.py
    python benchmarks/bench_sparse.py op --sparsity 0.9 --heads 56 --out sparse.json
    python benchmarks/bench_sparse.py op block forward --out sparse.json
    python benchmarks/bench_sparse.py --tiny
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined: before its first import

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2, synchronize, timer

from h3gen.kernels._dispatch import triton_available
from h3gen.kernels.attention import attention, fa3_available, resolve_backend
from h3gen.kernels.fp8_quant import head_descales
from h3gen.kernels.vsa_h3 import (
    build_tile_geometry,
    kept_video_tiles,
    pool_tiles,
    select_tiles,
    tile_scores,
    vsa_h3_attention,
)
from h3gen.kernels.vsa_h3 import reference as vsa_reference

# (text, condition, audio) rows and the video grid of the 5 s 768x1344 request, and of the --tiny run.
FULL = ((128, 0, 414), (37, 24, 42))
CHECK = ((128, 0, 414), (9, 12, 20))
TINY = ((7, 0, 30), (5, 6, 9))
TINY_CHECK = ((5, 0, 70), (3, 5, 9))


def _inputs(prefix, grid, heads, dim, dtype, device, seed):
    geometry = build_tile_geometry(prefix, grid).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, geometry.num_rows, heads, dim)
    q, k, v, gate = (torch.randn(*shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    return geometry, q, k, v, gate * 0.1


def _sparse_flops(geometry, selection, dim):
    """4·D·(query row, key row) pairs the sparse op computes: prefix query rows against every row, each video query
    tile's valid rows against the valid rows of its selected key tiles."""
    sizes = geometry.tile_sizes.long()
    key_rows = sizes[selection.q2k_idx.long()].sum(-1)  # (B, H, V)
    query_rows = sizes[selection.first_q_tile :]
    pairs = (key_rows * query_rows).sum() + selection.q2k_idx.shape[1] * geometry.prefix_rows * geometry.num_rows
    return 4 * dim * pairs.item()


def check_op(args, device, dtype, backend):
    """The op (its default backend on this device) against the fp32 reference on a shape small enough for the
    reference's token mask; rows of the table."""
    prefix, grid = TINY_CHECK if args.tiny else CHECK
    heads = min(args.heads, 8)
    geometry, q, k, v, gate = _inputs(prefix, grid, heads, args.dim, dtype, device, seed=1)
    rows = []
    for fp8 in (False, True) if backend == "triton" else (False,):
        for name, g in (("no gate", None), ("gate", gate)):
            got = vsa_h3_attention(q, k, v, geometry, args.sparsity, g, backend=backend, fp8=fp8)
            expected = vsa_reference.vsa_h3_attention(
                q.float(), k.float(), v.float(), geometry, args.sparsity, None if g is None else g.float()
            )
            rows.append(
                {
                    "variant": f"check {geometry.num_rows} rows x {heads} heads, {name}{', FP8' if fp8 else ''}",
                    "ms": "-",
                    "relL2": f"{rel_l2(got, expected):.2e}",
                }
            )
    return rows


def bench_op(args, device, dtype, backend):
    rows = check_op(args, device, dtype, backend)
    prefix, grid = TINY if args.tiny else FULL
    geometry, q, k, v, gate = _inputs(prefix, grid, args.heads, args.dim, dtype, device, seed=2)
    time = timer(device)
    dense_name = resolve_backend("auto", device, dtype, args.dim)
    dense_flops = 4 * args.dim * args.heads * geometry.num_rows**2

    if backend == "triton":
        from h3gen.kernels.vsa_h3 import triton_tiles  # after TRITON_INTERPRET is settled (see top)

        def tiling():
            k_slots, k_means = triton_tiles.tile_rows(k, geometry)
            return triton_tiles.tile_rows(q, geometry, copy=False)[1], k_means, k_slots

        def select(scores):
            return triton_tiles.select_tiles(scores, geometry, args.sparsity)
    else:

        def tiling():
            return [pool_tiles(t, geometry, backend) for t in (q, k)]

        def select(scores):
            return select_tiles(scores, geometry, args.sparsity)

    q_means, k_means, *_ = tiling()
    selection = select(tile_scores(q_means, k_means))
    sparse_flops = _sparse_flops(geometry, selection, args.dim)
    prefix_flops = 4 * args.dim * args.heads * geometry.prefix_rows * geometry.num_rows
    prefix = geometry.prefix_rows
    dense_ms = time(lambda: attention(q, k, v, backend="auto"), args.repeat)
    # A dense flash kernel's programs read every key and value row once per 128-row query block (FA3's block for
    # heads of 128); each VSA-H3 program reads its listed 64-row key tiles once per 64-row query tile.
    elem = q.element_size()
    dense_kv = -(-geometry.num_rows // 128) * args.heads * geometry.num_rows * 2 * args.dim * elem
    video_kv = int(selection.q2k_num.sum()) * 2 * 64 * args.dim * elem
    rows.append(_row(f"dense attention ({dense_name})", dense_ms, dense_flops, dense_kv))
    rows.append(_row("tiling: means of q; k tiled with its means", time(tiling, args.repeat), None))
    rows.append(
        _row("selection: scores, top-k", time(lambda: select(tile_scores(q_means, k_means)), args.repeat), None)
    )
    rows.append(
        _row(
            f"prefix query rows, dense ({dense_name})",
            time(lambda: attention(q[:, :prefix], k, v, backend="auto"), args.repeat),
            prefix_flops,
        )
    )
    op_ms = {}
    for name, g in (("no gate", None), ("gate", gate)):
        op_ms[name] = time(
            lambda g=g: vsa_h3_attention(q, k, v, geometry, args.sparsity, g, backend=backend), args.repeat
        )
        rows.append(_row(f"VSA-H3 op, {backend}, {name}", op_ms[name], sparse_flops))
    if backend == "triton":
        import triton

        from h3gen.kernels.vsa_h3 import triton as vsa_triton  # after TRITON_INTERPRET is settled (see top)

        in_kernel = vsa_triton.KernelConfig(prefix_in_kernel=True)
        for name, g in (("no gate", None), ("gate", gate)):
            ms = time(
                lambda g=g: vsa_h3_attention(q, k, v, geometry, args.sparsity, g, backend=backend, config=in_kernel),
                args.repeat,
            )
            rows.append(_row(f"VSA-H3 op, triton, {name}, prefix rows in the kernel", ms, sparse_flops))

        out = torch.empty_like(q)
        slots = [triton_tiles.tile_rows(t, geometry)[0] for t in (k, v)]
        descales = torch.stack([head_descales(t) for t in (q, k, v)])
        fp8_slots = [
            triton_tiles.tile_rows(t, geometry, descale=d, transposed=t is v)[0]
            for t, d in ((k, descales[1]), (v, descales[2]))
        ]
        video_flops = sparse_flops - prefix_flops
        for config in vsa_triton.CONFIGS[:1] if args.tiny else vsa_triton.CONFIGS:
            how = "TMA" if config.tma else "pointers"
            for fp8 in (False, True):
                name = f"kernel alone{', FP8' if fp8 else ''}, {config.num_warps} warps, {config.num_stages} stages, "
                name += f"through {how}"
                try:
                    ms = time(
                        lambda c=config, fp8=fp8: vsa_triton.block_sparse_attention(
                            q,
                            *(fp8_slots if fp8 else slots),
                            selection,
                            geometry,
                            out,
                            config=c,
                            descales=descales if fp8 else None,
                        ),
                        args.repeat,
                    )
                except triton.runtime.errors.OutOfResources as error:  # a deep pipeline of wide steps: too much smem
                    rows.append({"variant": f"{name}: not launched ({error})", "ms": "-", "TFLOP/s": "-", "relL2": "-"})
                    continue
                rows.append(_row(name, ms, video_flops, video_kv // 2 if fp8 else video_kv))
        if device.type == "cuda":  # the halves of the kernel, each alone (sparse_floors.py): which one bounds it
            import sparse_floors

            config = vsa_triton.default_config(device, args.dim)
            for reads in (replace(config, tma=False), config) if config.tma else (config,):
                ms = time(lambda r=reads: sparse_floors.reads_only(*slots, selection, r), args.repeat)
                how = "TMA" if reads.tma else "pointers"
                rows.append(_row(f"its reads alone (no math), through {how}", ms, None, video_kv))
            ms = time(lambda: sparse_floors.math_only(q, *slots, selection, geometry, out, config), args.repeat)
            rows.append(_row("its math alone (one key tile, loaded once)", ms, video_flops))
    fp8_ratios = {}
    if backend == "triton":  # the fast tier's: keys and values in e4m3, against FA3's FP8 dense attention
        fp8_dense = "fa3-fp8" if fa3_available() else None
        if fp8_dense:
            fp8_dense_ms = time(lambda: attention(q, k, v, backend=fp8_dense), args.repeat)
            rows.append(_row(f"dense attention, FP8 ({fp8_dense})", fp8_dense_ms, dense_flops, dense_kv // 2))
        for name, g in (("no gate", None), ("gate", gate)):
            ms = time(
                lambda g=g: vsa_h3_attention(
                    q, k, v, geometry, args.sparsity, g, backend=backend, dense_backend="auto", fp8=True
                ),
                args.repeat,
            )
            op_ms[f"FP8, {name}"] = ms
            rows.append(_row(f"VSA-H3 op, triton, FP8, {name}", ms, sparse_flops))
            if fp8_dense:
                fp8_ratios[f"FP8 dense / FP8, {name}"] = fp8_dense_ms / ms
    kept = kept_video_tiles(args.sparsity, geometry.num_video_tiles)
    summary = (
        f"{geometry.num_rows} rows, {args.heads} heads x {args.dim}, {dtype}; {geometry.num_prefix_tiles} prefix + "
        f"{geometry.num_video_tiles} video tiles, k = {kept} at sparsity {args.sparsity}; "
        f"{sparse_flops / dense_flops:.1%} of the dense FLOPs"
    )
    ratios = {name: dense_ms / ms for name, ms in op_ms.items()} | fp8_ratios
    return rows, summary, ratios


def _row(variant, ms, flops, kv_bytes=None):
    """A table row; `kv_bytes`, the key and value bytes the kernel's programs read (each program reads its key tiles
    once, so from L2 or memory), gives the rate they arrive at."""
    return {
        "variant": variant,
        "ms": f"{ms:.3f}",
        "TFLOP/s": f"{flops / ms / 1e9:.0f}" if flops else "-",
        "K/V TB/s": f"{kv_bytes / ms / 1e9:.1f}" if kv_bytes else "-",
        "relL2": "-",
    }


def bench_block(args, device, dtype, backend):
    """One transformer block at released dims over the same rows: the base block dense and at `--sparsity`
    (no gate), and a VSA student's block (gate) at `--sparsity`, in the lossless and fast tiers. The block updates the
    residual stream in place, so each timed call gets a fresh copy (copied outside the timing)."""
    from bench_h3_block import make_inputs

    from h3gen.kernels.vsa_h3 import SparsePlan, SparseSwitch
    from h3gen.linear import dense_linear
    from h3gen.pipelines.h3.tiers import fast_block_forward, fused_block_forward, quantize_block_linears
    from h3gen.pipelines.h3.transformer_blocks import H3TransformerBlock
    from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

    prefix, grid = TINY if args.tiny else FULL
    config = H3TransformerConfig() if not args.tiny else H3TransformerConfig(**TINY_BLOCK)
    geometry = build_tile_geometry(prefix, grid).to(device)
    rows = geometry.num_rows
    x, temb, adaln_indices, rotary = make_inputs(rows, device, config=config, dtype=dtype)
    switch = SparseSwitch()
    torch.manual_seed(0)
    student = H3TransformerBlock(config, dense_linear, gates=True, sparse=switch).to(device, dtype).eval()
    with torch.no_grad():
        student.attn.to_gate_compress.weight.mul_(0.1)
    table = student.adaln_proj.table(temb)
    time = timer(device)
    results, rows_out = {}, []
    for tier, forward in (("lossless", fused_block_forward), ("fast", fast_block_forward)):
        if tier == "fast":
            if args.tiny:
                continue  # FP8 GEMMs need a GPU
            quantize_block_linears(student)
        gate = student.attn.to_gate_compress
        # The tier's attention as `set_quality` sets it; under FA3's FP8 the sparse kernel reads e4m3 key tiles, and
        # the student once more over bf16 tiles ("auto") shows what that gains.
        attention_backend = "fa3-fp8" if tier == "fast" and fa3_available() else "auto"
        plan = SparsePlan(geometry, args.sparsity)
        variants = [
            ("dense", None, False, attention_backend),
            (f"sparse {args.sparsity}", plan, False, attention_backend),
            (f"student, sparse {args.sparsity}", plan, True, attention_backend),
        ]
        if attention_backend == "fa3-fp8":
            variants.append((f"student, sparse {args.sparsity}, bf16 key tiles", plan, True, "auto"))
        for name, plan, with_gate, attention_backend in variants:
            student.attn.to_gate_compress = gate if with_gate else None
            student.attn.core.backend = attention_backend
            switch.plan = plan
            work = x.clone()

            def run(work=work):
                work.copy_(x)
                with torch.no_grad():
                    forward(student, work, table, adaln_indices, rotary)

            results[(tier, name)] = time(run, args.repeat)
            rows_out.append(_row(f"block, {tier}, {name}", results[(tier, name)], None))
        student.attn.to_gate_compress = gate
        switch.plan = None
    summary = f"one block, {rows} rows, {dtype}; sparsity {args.sparsity}; each call includes a copy of the stream"
    ratios = {
        f"{tier}, {name}": results[(tier, "dense")] / results[(tier, name)] for tier, name in results if name != "dense"
    }
    ratios |= {
        "lossless dense / fast student": results[("lossless", "dense")]
        / results.get(("fast", f"student, sparse {args.sparsity}"), float("nan"))
    }
    return rows_out, summary, ratios


def bench_forward(args, device, dtype, backend):
    """The whole transformer (50 blocks at released dims, random weights, a VSA student's gates included: 70 GB in
    bf16) over the 5 s 768x1344 rows, one forward per timed call: dense (gates set aside), the base model at the
    default schedule's sparsity (0.75, no gate), the student at `--sparsity` with its gates, lossless; then the
    student in the fast tier (its GEMMs quantized in place, last)."""
    from bench_h3_step import inputs

    from h3gen.kernels.vsa_h3 import SparsePlan
    from h3gen.loading.load import meta_parameters
    from h3gen.pipelines.h3.random_weights import materialize
    from h3gen.pipelines.h3.sparse_attention import DEFAULT_SPARSITY
    from h3gen.pipelines.h3.tiers import set_quality
    from h3gen.pipelines.h3.transformer import H3Transformer
    from h3gen.pipelines.h3.transformer_config import KEEP_FP32_MODULES, H3TransformerConfig

    prefix, grid = TINY if args.tiny else FULL
    config = H3TransformerConfig(**TINY_BLOCK, num_layers=2) if args.tiny else H3TransformerConfig()
    with meta_parameters():
        model = H3Transformer(config, gates=True)
    materialize(model, device=device, dtype=dtype, keep_fp32=KEEP_FP32_MODULES, seed=0)
    model.eval()
    geometry = build_tile_geometry(prefix, grid).to(device)
    kwargs = inputs(geometry.num_rows, config, device, text_rows=prefix[0], audio_rows=prefix[2])
    gates = [block.attn.to_gate_compress for block in model.transformer_blocks]
    time = timer(device)
    results, rows_out = {}, []

    def run_forward(tables):
        with torch.no_grad():
            return model(**kwargs, return_dict=False, adaln_tables=tables, step=0)

    for tier in ("lossless", "fast"):
        if tier == "fast" and args.tiny:
            continue
        set_quality(model, tier)
        tier_backend = model.transformer_blocks[0].attn.core.backend
        tables = model.precompute_adaln([kwargs["timestep"]])
        variants = [("student", args.sparsity, True, tier_backend)]
        if tier == "lossless":
            variants = [
                ("dense", None, False, tier_backend),
                ("base", DEFAULT_SPARSITY, False, tier_backend),
                *variants,
            ]
        elif tier_backend == "fa3-fp8":  # the sparse kernel over bf16 key tiles, for comparison
            variants.append(("student, bf16 key tiles", args.sparsity, True, "auto"))
        for name, sparsity, gated, attention_backend in variants:
            for block, gate in zip(model.transformer_blocks, gates, strict=True):
                block.attn.to_gate_compress = gate if gated else None
                block.attn.core.backend = attention_backend
            model.sparse.plan = None if sparsity is None else SparsePlan(geometry, sparsity)
            label = f"forward, {tier}, {name}" + ("" if sparsity is None else f", sparse {sparsity}")
            results[label] = time(lambda tables=tables: run_forward(tables), max(2, args.repeat // 3))
            rows_out.append(_row(label, results[label], None))
        model.sparse.plan = None
    summary = f"{config.num_layers} blocks, {geometry.num_rows} rows, {dtype}; ms per forward"
    dense = results["forward, lossless, dense"]
    ratios = {label: dense / ms for label, ms in results.items() if "dense" not in label}
    return rows_out, summary, ratios


# The tiny block of `--tiny`: 2 heads of 32 (what the interpreted kernel takes).
TINY_BLOCK = dict(
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, ffn_dim=128, time_embed_dim=32, rope_freq_dim=4
)
SECTIONS = {"op": bench_op, "block": bench_block, "forward": bench_forward}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="*", metavar="section", help=f"any of {', '.join(SECTIONS)} (default: op)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (fp32; the kernel interpreted)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.heads, args.dim, args.repeat = min(args.heads, 2), min(args.dim, 32), 1
    elif device.type != "cuda":
        parser.error("the full shape needs a CUDA GPU; use --tiny on the CPU")
    # The interpreter gets bf16 wrong: fp32 on the CPU.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = (
        "triton"
        if triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET"))
        else "reference"
    )
    results = {}
    for section in args.sections or ["op"]:
        rows, summary, ratios = SECTIONS[section](args, device, dtype, backend)
        synchronize(device)
        print(f"== {section}: {summary}")
        print_table(rows, ["variant", "ms", "TFLOP/s", "K/V TB/s", "relL2"])
        results[section] = {"summary": summary, "rows": rows, "dense/sparse": ratios}
        print(" ".join(f"dense/sparse ({name}) = {ratio:.2f}x" for name, ratio in ratios.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
