"""MXFP4-weight GEMM (our Triton kernel, dequantizing in the kernel) against bf16 cuBLAS at MiniMax-H3's GEMM shapes
(K x N: 5376x7168, 7168x5376, 5376x28672, 14336x5376) for M in {1, 8, 16, 256, 4096, 37838}, in one process on
the same inputs; then one full-size block with MXFP4 linears against bf16 (error, weight bytes per block).

Prints per shape and M: time, TFLOP/s, bandwidth on the packed weight bytes, speedup over bf16, error against the
bf16 product of the dequantized weight.

    python benchmarks/bench_mxfp4.py
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2, time_cuda  # noqa: E402

from h3gen.kernels.mxfp4_gemm import triton as mxfp4  # noqa: E402
from h3gen.quant.mxfp4 import dequantize, quantize  # noqa: E402

SHAPES = [(5376, 7168), (7168, 5376), (5376, 28672), (14336, 5376)]
ROWS = [1, 8, 16, 256, 4096, 37838]


def bench_gemms(rows_list, repeat):
    table = []
    for k, n in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        packed, scales = quantize(weight)
        dequantized = dequantize(packed, scales, torch.bfloat16)
        packed_bytes = packed.numel() + scales.numel()
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = x @ dequantized.t()
            bf16_ms = time_cuda(lambda: x @ weight.t(), repeat=repeat)
            ours_ms = time_cuda(lambda: mxfp4.mxfp4_matmul(x, packed, scales), repeat=repeat)
            got = mxfp4.mxfp4_matmul(x, packed, scales)
            flops = 2 * m * n * k
            table.append({"K x N": f"{k}x{n}", "M": m, "bf16 ms": f"{bf16_ms:.4f}", "mxfp4 ms": f"{ours_ms:.4f}",
                          "mxfp4 TFLOP/s": f"{flops / ours_ms / 1e9:.0f}",
                          "packed GB/s": f"{packed_bytes / ours_ms / 1e6:.0f}",
                          "x bf16": f"{bf16_ms / ours_ms:.2f}", "relL2": f"{rel_l2(got, expected):.1e}"})
    return table


def bench_block(repeat):
    """One full-size block: MXFP4 linears (q/k/v/out, SwiGLU, AdaLN) against bf16; error and weight bytes."""
    from bench_h3_block import CFG, make_inputs

    from h3gen.linear import dense_linear
    from h3gen.pipelines.h3.tiers import fused_block_forward
    from h3gen.pipelines.h3.transformer import H3TransformerBlock
    from h3gen.quant.mxfp4 import mxfp4_linear_factory

    torch.manual_seed(0)
    dense = H3TransformerBlock(CFG, dense_linear).to("cuda", torch.bfloat16).eval()
    quantized = H3TransformerBlock(CFG, mxfp4_linear_factory()).to("cuda").eval()
    for name, module in quantized.named_modules():
        if hasattr(module, "set_weight"):
            module.set_weight(dense.get_submodule(name).weight)
            module.compute_dtype = torch.bfloat16
            if module.bias is not None:
                module.bias = torch.nn.Parameter(dense.get_submodule(name).bias.detach().clone())
    for name, param in quantized.named_parameters():
        if "norm" in name:
            param.data = dense.get_parameter(name).data.clone()
    x, temb, idx, rope = make_inputs(8192, "cuda")
    rows = []
    with torch.no_grad():
        outputs = {}
        for label, block in (("bf16", dense), ("mxfp4", quantized)):
            block.fused_forward, block.attn.core.backend = fused_block_forward, "auto"
            outputs[label] = block(x.clone(), temb, idx, rope)
            ms = time_cuda(lambda b=block: b(x.clone(), temb, idx, rope), repeat=repeat)
            nbytes = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
            rows.append({"block (8192 rows)": label, "ms": f"{ms:.2f}", "weight GB": f"{nbytes / 1e9:.3f}"})
    rows[1]["relL2 vs bf16"] = f"{rel_l2(outputs['mxfp4'], outputs['bf16']):.2e}"
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gemms = bench_gemms(args.rows, args.repeat)
    block = bench_block(args.repeat)
    if args.out:
        args.out.write_text(json.dumps({"gemm": gemms, "block": block}, indent=2))
    print_table(block, ["block (8192 rows)", "ms", "weight GB", "relL2 vs bf16"])
    print()
    print_table(gemms, ["K x N", "M", "bf16 ms", "mxfp4 ms", "mxfp4 TFLOP/s", "packed GB/s", "x bf16", "relL2"])


if __name__ == "__main__":
    main()
