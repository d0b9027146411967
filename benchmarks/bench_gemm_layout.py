"""The block's bf16 GEMMs at released dims under different weight layouts and BLAS back ends, same inputs, same
process: `F.linear` on the stored `[out, in]` weight (what the block does), on a column-major copy (the same
weight stored transposed, so cuBLAS runs NN instead of TN), and with cuBLASLt preferred. Prints time and TFLOP/s
per GEMM and rows, and the block-level sum.

    python benchmarks/bench_gemm_layout.py --rows 8192 37838
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_cuda  # noqa: E402

HIDDEN, FFN = 5376, 14336
GEMMS = [("to_q/k/v (x3)", HIDDEN, HIDDEN, 3), ("to_out", HIDDEN, HIDDEN, 1), ("ffn up", HIDDEN, 2 * FFN, 1),
         ("ffn down", FFN, HIDDEN, 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 37838])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    table, totals = [], {}
    for rows in args.rows:
        for name, k, n, count in GEMMS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            column_major = weight.t().contiguous().t()  # same values and shape, transposed storage
            expected = F.linear(x, weight, bias)
            variants = {"row-major (ours)": lambda: F.linear(x, weight, bias),
                        "column-major": lambda: F.linear(x, column_major, bias)}
            row = {"rows": rows, "GEMM": name}
            for label, fn in variants.items():
                assert torch.equal(fn(), expected) or (fn() - expected).abs().max() < 1e-2
                ms = time_cuda(fn, repeat=args.repeat)
                row[label] = f"{ms:.3f} ({2 * rows * k * n / ms / 1e9:.0f})"
                totals[(rows, label)] = totals.get((rows, label), 0.0) + count * ms
            for label, fn in variants.items():
                torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    ms = time_cuda(fn, repeat=args.repeat)
                finally:
                    torch.backends.cuda.preferred_blas_library("cublas")
                key = f"{label}, cuBLASLt"
                row[key] = f"{ms:.3f} ({2 * rows * k * n / ms / 1e9:.0f})"
                totals[(rows, key)] = totals.get((rows, key), 0.0) + count * ms
            table.append(row)
            print(row, flush=True)
    columns = ["rows", "GEMM", "row-major (ours)", "column-major", "row-major (ours), cuBLASLt",
               "column-major, cuBLASLt"]
    for rows in args.rows:
        table.append({"rows": rows, "GEMM": "block sum", **{c: f"{totals[(rows, c)]:.3f}" for c in columns[2:]}})
    if args.out:
        args.out.write_text(json.dumps(table, indent=2))
    print()
    print_table(table, columns)


if __name__ == "__main__":
    main()
