"""Attention at H3 shapes (56 heads x 128, one packed sequence): cuDNN SDPA against FlashAttention-3 (bf16 and
FP8) and cuDNN over the same problem cut differently; plus FP8 GEMMs (`torch._scaled_mm`, row/column scales)
against bf16 at the block's GEMM shapes. Prints time, TFLOP/s and the error against cuDNN.

    python benchmarks/bench_attention.py --rows 8192 37838
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, rel_l2, time_cuda

from h3gen.kernels.attention import attention
from h3gen.kernels.fp8_quant import quantize_rows

HEADS, DIM = 56, 128


def bench_attention(rows, repeat):
    g = torch.Generator(device="cuda").manual_seed(rows)
    q, k, v = (torch.randn(1, rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * rows * rows * HEADS * DIM
    expected = attention(q, k, v, backend="cudnn")
    table = [
        {
            "rows": rows,
            "kernel": "cuDNN SDPA",
            "ms": time_cuda(lambda: attention(q, k, v, backend="cudnn"), repeat=repeat),
            "relL2": 0.0,
        }
    ]
    for backend in ("fa3", "fa3-fp8"):
        try:
            ms = time_cuda(lambda: attention(q, k, v, backend=backend), repeat=repeat)
            table.append(
                {
                    "rows": rows,
                    "kernel": f"FlashAttention-3 ({backend})",
                    "ms": ms,
                    "relL2": rel_l2(attention(q, k, v, backend=backend), expected),
                }
            )
        except Exception as error:
            table.append(
                {
                    "rows": rows,
                    "kernel": f"FlashAttention-3 ({backend})",
                    "ms": float("nan"),
                    "relL2": float("nan"),
                    "note": f"{type(error).__name__}: {str(error)[:60]}",
                }
            )
    for row in table:
        row["TFLOP/s"] = f"{flops / row['ms'] / 1e9:.0f}" if row["ms"] == row["ms"] else "-"
        row["ms"] = f"{row['ms']:.3f}"
        row["relL2"] = f"{row['relL2']:.2e}"
    return table


def bench_attention_splits(rows, repeat):
    """cuDNN SDPA over the same problem cut differently: all heads at once, groups of heads, chunks of queries.
    Same FLOPs; tells whether cuDNN's long-sequence rate is a scheduling / cache effect a split avoids."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(rows)
    q, k, v = (torch.randn(1, HEADS, rows, DIM, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * rows * rows * HEADS * DIM
    out = torch.empty_like(q)

    def heads_in_groups(size):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for h in range(0, HEADS, size):
                    out[:, h : h + size] = F.scaled_dot_product_attention(
                        q[:, h : h + size], k[:, h : h + size], v[:, h : h + size]
                    )

        return run

    def queries_in_chunks(chunks):
        def run():
            step = -(-rows // chunks)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for start in range(0, rows, step):
                    out[:, :, start : start + step] = F.scaled_dot_product_attention(
                        q[:, :, start : start + step], k, v
                    )

        return run

    table = []
    for name, fn in (
        [("all 56 heads", heads_in_groups(HEADS))]
        + [(f"heads in groups of {size}", heads_in_groups(size)) for size in (28, 14, 8, 4)]
        + [(f"queries in {chunks} chunks", queries_in_chunks(chunks)) for chunks in (2, 4)]
    ):
        ms = time_cuda(fn, repeat=repeat)
        table.append(
            {
                "rows": rows,
                "kernel": f"cuDNN, {name}",
                "ms": f"{ms:.3f}",
                "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                "relL2": "-",
            }
        )
    return table


def bench_gemms(rows, repeat):
    table = []
    x = torch.randn(rows, 5376, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * 7168, 5376, device="cuda", dtype=torch.bfloat16) / 5376**0.5
    flops = 2 * rows * 5376 * 3 * 7168
    parts = w.chunk(3)
    for variant, fn in (("3 GEMMs", lambda: [x @ p.t() for p in parts]), ("1 fused GEMM", lambda: x @ w.t())):
        ms = time_cuda(fn, repeat=repeat)
        table.append(
            {
                "rows": rows,
                "gemm": "q+k+v",
                "variant": variant,
                "ms": f"{ms:.3f}",
                "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                "relL2": "-",
            }
        )
    for name, k, n in (
        ("qkv (each)", 5376, 7168),
        ("out", 7168, 5376),
        ("ff up", 5376, 28672),
        ("ff down", 14336, 5376),
    ):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        flops = 2 * rows * k * n
        expected = x @ w.t()
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)
        ws = ws.reshape(1, -1).contiguous()

        def fp8_mm():
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

        def fp8_with_quant():
            q, s = quantize_rows(x)
            return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)

        for variant, fn in (("bf16", lambda: x @ w.t()), ("fp8 mm", fp8_mm), ("fp8 quant+mm", fp8_with_quant)):
            ms = time_cuda(fn, repeat=repeat)
            table.append(
                {
                    "rows": rows,
                    "gemm": name,
                    "variant": variant,
                    "ms": f"{ms:.3f}",
                    "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                    "relL2": f"{rel_l2(fn(), expected):.2e}",
                }
            )
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 37838])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--splits-only", action="store_true", help="only cuDNN cut differently (no FlashAttention-3)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    attention_rows, gemm_rows = [], []
    for rows in args.rows:
        attention_rows += bench_attention_splits(rows, args.repeat)
        if not args.splits_only:
            attention_rows += bench_attention(rows, args.repeat)
        gemm_rows += bench_gemms(rows, args.repeat)
    if args.out:
        args.out.write_text(json.dumps({"attention": attention_rows, "gemm": gemm_rows}, indent=2))
    print_table(gemm_rows, ["rows", "gemm", "variant", "ms", "TFLOP/s", "relL2"])
    print()
    print_table(attention_rows, ["rows", "kernel", "ms", "TFLOP/s", "relL2", "note"])


if __name__ == "__main__":
    main()
