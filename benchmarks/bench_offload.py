"""Layer-wise offload of 8 full-size MiniMax-H3 blocks: ours (pinned host stores, prefetching ring, AdaLN tables
precomputed so AdaLN weights never stream) against all blocks resident and against diffusers' group offloading
(block level, one block per group, streams) on the same weights and inputs, at 37,838 and 8,192 rows.

Prints per variant: time of the 8-block forward, ratio to all-resident, ratio of diffusers' group offloading to
ours, peak GPU memory and host memory held.

    python benchmarks/bench_offload.py --rows 8192 [--resident 2] [--mxfp4]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_h3_block import CFG, FFN, HEAD_DIM, HEADS, HIDDEN, make_inputs
from common import print_table, rel_l2, time_cuda

from h3gen.linear import dense_linear, make_linear_factory
from h3gen.offload.layerwise import LayerwiseOffload
from h3gen.offload.residency import OffloadPlan, spread
from h3gen.pipelines.h3.tiers import fused_block_forward
from h3gen.pipelines.h3.transformer_blocks import H3TransformerBlock

GiB = 2**30


def mxfp4_copy(block: H3TransformerBlock, device="cuda", config=CFG) -> H3TransformerBlock:
    """`block` (on `device`) with its block linears quantized to MXFP4 there, returned on the host."""
    with torch.device("meta"):
        quantized = H3TransformerBlock(config, make_linear_factory(quantization="mxfp4"))
    quantized = quantized.to_empty(device=device)
    for name, module in quantized.named_modules():
        if hasattr(module, "set_weight"):
            source = block.get_submodule(name)
            module.set_weight(source.weight)
            module.compute_dtype = torch.bfloat16
            if module.bias is not None:
                module.bias = nn.Parameter(source.bias.detach().clone(), requires_grad=False)
    dense_state = block.state_dict()
    for name, tensor in quantized.state_dict().items():
        if name in dense_state and tensor.dtype != torch.uint8:
            tensor.copy_(dense_state[name])
    quantized.fused_forward, quantized.attn.core.backend = fused_block_forward, "auto"
    return quantized.eval().cpu()


def build(count: int, mxfp4: bool = False):
    """`count` random blocks in bf16: ours on the host (CPU) and diffusers' with the same weights (and, with
    `mxfp4`, a third list: ours with MXFP4 block linears)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    torch.manual_seed(0)
    ours, theirs, quantized = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
    for _ in range(count):
        with torch.device("cuda"):
            block = H3TransformerBlock(CFG, dense_linear).to(torch.bfloat16).eval()
            reference = (
                MiniMaxH3TransformerBlock(
                    HIDDEN, HEADS, HEAD_DIM, FFN, CFG.time_embed_dim, CFG.norm_eps, CFG.qk_norm_eps
                )
                .to(torch.bfloat16)
                .eval()
            )
        reference.load_state_dict(block.state_dict())
        block.fused_forward, block.attn.core.backend = fused_block_forward, "auto"
        if mxfp4:
            quantized.append(mxfp4_copy(block))
        ours.append(block.cpu())
        theirs.append(reference.cpu())
    return ours, theirs, quantized


def forward_ours(blocks, x, tables, idx, rope):
    for block, table in zip(blocks, tables, strict=False):
        x = block(x, None, idx, rope, modulation=table)
    return x


def forward_theirs(blocks, x, temb, idx, rope):
    for block in blocks:
        x = block(x, temb, idx, rope)
    return x


def measure(fn, x, repeat):
    work = x.clone()
    torch.cuda.reset_peak_memory_stats()
    ms = time_cuda(lambda: fn(work), warmup=2, repeat=repeat, setup=lambda: work.copy_(x))
    return ms, torch.cuda.max_memory_allocated() / GiB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=37838, help="one size per process (hooks stay on the blocks)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--resident", type=int, default=0, help="blocks the planner keeps on the GPU (strided)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mxfp4", action="store_true", help="also MXFP4 blocks, resident and streamed")
    parser.add_argument(
        "--gpu-cap-gib",
        type=float,
        default=None,
        help="after the all-resident run, cap this process's GPU memory "
        "(torch.cuda.set_per_process_memory_fraction) so that the blocks cannot all be resident",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from diffusers.hooks import apply_group_offloading

    ours, theirs, quantized = build(args.blocks, args.mxfp4)
    rows = args.rows
    x, temb, idx, rope = make_inputs(rows, "cuda")
    with torch.no_grad():
        # All resident, uncapped (ours, lossless tier; and the MXFP4 copy).
        ours.to("cuda")
        tables = [block.adaln_proj.table(temb) for block in ours]
        expected = forward_ours(ours, x.clone(), tables, idx, rope)
        resident_ms, resident_peak = measure(lambda h: forward_ours(ours, h, tables, idx, rope), x, args.repeat)
        ours.cpu()
        torch.cuda.empty_cache()
        if args.mxfp4:
            quantized.to("cuda")
            tables_q = [block.adaln_proj.table(temb) for block in quantized]
            expected_q = forward_ours(quantized, x.clone(), tables_q, idx, rope)
            q_resident_ms, q_resident_peak = measure(
                lambda h: forward_ours(quantized, h, tables_q, idx, rope), x, args.repeat
            )
            quantized.cpu()
            torch.cuda.empty_cache()
        if args.gpu_cap_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GiB / total))
            print(
                f"GPU memory capped at {args.gpu_cap_gib:.1f} GiB (all-resident peak was {resident_peak:.1f} GiB)",
                flush=True,
            )

        # Ours: the planned blocks streamed from pinned host memory; AdaLN tables computed once (weights loaded on
        # demand for that), so AdaLN weights do not stream per step.
        kept = tuple(spread(args.resident, args.blocks))
        plan = OffloadPlan(kept, tuple(i for i in range(args.blocks) if i not in kept), args.prefetch + 1, 0)

        def streamed(blocks):
            """(ms, peak GiB, output, pinned GiB, ring GiB) of `blocks` streamed by `plan`; leaves the GPU empty."""
            offload = LayerwiseOffload(blocks, plan, "cuda", prefetch=args.prefetch)
            block_tables = [block.adaln_proj.table(temb) for block in blocks]
            out = forward_ours(blocks, x.clone(), block_tables, idx, rope)
            ms, peak = measure(lambda h: forward_ours(blocks, h, block_tables, idx, rope), x, args.repeat)
            pinned, ring = offload.pinned_bytes / GiB, offload.ring_bytes / GiB
            offload.remove()
            blocks.cpu()  # the resident blocks
            del offload
            torch.cuda.empty_cache()
            return ms, peak, out, pinned, ring

        ours_ms, ours_peak, got, pinned, ring = streamed(ours)
        mxfp4_rows = []
        if args.mxfp4:  # the same blocks with MXFP4 linears: packed bytes stream, dequantized on the GPU
            q_ms, q_peak, got_q, q_pinned, q_ring = streamed(quantized)
            mxfp4_rows = [
                {
                    "rows": rows,
                    "variant": "MXFP4 all resident (uncapped)",
                    "ms": f"{q_resident_ms:.1f}",
                    "x resident": f"{q_resident_ms / resident_ms:.3f}",
                    "peak GPU GiB": f"{q_resident_peak:.1f}",
                    "host GiB": "-",
                    "relL2": f"{rel_l2(expected_q, expected):.1e}",
                },
                {
                    "rows": rows,
                    "variant": f"MXFP4 layer-wise, {args.blocks - args.resident} of {args.blocks} "
                    f"streamed ({q_ms / q_resident_ms:.3f}x MXFP4 resident)",
                    "ms": f"{q_ms:.1f}",
                    "x resident": f"{q_ms / resident_ms:.3f}",
                    "peak GPU GiB": f"{q_peak:.1f}",
                    "host GiB": f"{q_pinned:.2f} pinned, ring {q_ring:.2f}",
                    "relL2": f"{rel_l2(got_q, expected_q):.1e} (vs MXFP4 resident)",
                },
            ]

        # diffusers' group offloading, block level, one block per group, with streams.
        holder = nn.Module()
        holder.blocks = theirs
        apply_group_offloading(
            holder,
            onload_device=torch.device("cuda"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=True,
        )
        reference = forward_theirs(theirs, x.clone(), temb, idx, rope)
        theirs_ms, theirs_peak = measure(lambda h: forward_theirs(theirs, h, temb, idx, rope), x, args.repeat)

    rows_out = [
        {
            "rows": rows,
            "variant": "all resident (ours, lossless, uncapped)",
            "ms": f"{resident_ms:.1f}",
            "x resident": "1.000",
            "peak GPU GiB": f"{resident_peak:.1f}",
            "host GiB": "-",
            "relL2": "0",
        },
        {
            "rows": rows,
            "variant": f"ours layer-wise, {args.blocks - args.resident} of {args.blocks} streamed, "
            f"prefetch {args.prefetch}",
            "ms": f"{ours_ms:.1f}",
            "x resident": f"{ours_ms / resident_ms:.3f}",
            "peak GPU GiB": f"{ours_peak:.1f}",
            "host GiB": f"{pinned:.1f} pinned, ring {ring:.1f} on GPU",
            "relL2": f"{rel_l2(got, expected):.1e}",
        },
        {
            "rows": rows,
            "variant": "diffusers group offloading (block, stream)",
            "ms": f"{theirs_ms:.1f}",
            "x resident": f"{theirs_ms / resident_ms:.3f}",
            "peak GPU GiB": f"{theirs_peak:.1f}",
            "host GiB": f"{sum(p.numel() * 2 for p in theirs.parameters()) / GiB:.1f}",
            "relL2": f"{rel_l2(reference, expected):.1e}",
            "ours faster": f"{theirs_ms / ours_ms:.2f}x",
        },
    ] + mxfp4_rows
    if args.out:
        args.out.write_text(json.dumps(rows_out, indent=2))
    print_table(rows_out, ["rows", "variant", "ms", "x resident", "peak GPU GiB", "host GiB", "relL2", "ours faster"])


if __name__ == "__main__":
    main()
