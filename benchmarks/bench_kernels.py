"""Launch configurations of the row kernels at H3 shapes (hidden 5376, 56 heads x 128, SwiGLU 14336), to pick the
defaults: time and achieved bandwidth per config, best first per kernel. With `--update-rank R`, also the tiled
SwiGLU and q/k norm + RoPE kernels that add a rank-R low-rank update (an unmerged LoRA) as they read, next to the
cuBLAS add they replace (`addmm_` with beta = 1 into the projection's output).

    python benchmarks/bench_kernels.py --rows 8192 37838 --update-rank 128
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_cuda  # noqa: E402

from h3gen.kernels.gated_residual import triton as residual  # noqa: E402
from h3gen.kernels.norm_modulate import triton as norm  # noqa: E402
from h3gen.kernels.qk_norm_rope import triton as rope  # noqa: E402
from h3gen.kernels.swiglu import triton as swiglu  # noqa: E402

HIDDEN, HEADS, DIM, FFN = 5376, 56, 128, 14336


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 37838])
    parser.add_argument("--update-rank", type=int, default=0, help="also time the kernels that add a low-rank "
                                                                  "update of this rank (0: skip)")
    parser.add_argument("--only-updates", action="store_true", help="time only the update kernels")
    args = parser.parse_args()
    table = []
    for rows in args.rows:
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, y = torch.randn(1, rows, HIDDEN, **bf16), torch.randn(1, rows, HIDDEN, **bf16)
        weight, tab = torch.randn(HIDDEN, **bf16), torch.randn(6, 6 * HIDDEN, **bf16)
        shift, scale, gate = tab[:, :HIDDEN], tab[:, HIDDEN:2 * HIDDEN], tab[:, 2 * HIDDEN:3 * HIDDEN]
        index = torch.randint(0, 6, (rows,), device="cuda")
        q, k = torch.randn(1, rows, HEADS, DIM, **bf16), torch.randn(1, rows, HEADS, DIM, **bf16)
        cos, sin = torch.randn(rows, 96, device="cuda"), torch.randn(rows, 96, device="cuda")
        up = torch.randn(1, rows, 2 * FFN, **bf16)
        row = rows * HIDDEN * 2
        cases = [(f"rmsnorm_modulate w{w}", 2 * row, lambda w=w: norm.rmsnorm_modulate(
            x, weight, shift, scale, index, 1e-5, num_warps=w)) for w in (4, 8, 16)]
        cases += [(f"gated_residual_norm_modulate w{w}", 4 * row, lambda w=w: residual.gated_residual_norm_modulate(
            x, y, gate, index, weight, shift, scale, 1e-5, num_warps=w)) for w in (4, 8, 16)]
        cases += [(f"gated_residual w{w}", 3 * row, lambda w=w: residual.gated_residual(
            x, y, gate, index, num_warps=w)) for w in (4, 8, 16)]
        cases += [(f"qk_norm_rope {h} heads/program w{w}", 4 * rows * HEADS * DIM * 2,
                   lambda h=h, w=w: rope.qk_norm_rope(q, k, weight[:DIM], weight[:DIM], cos, sin, 1e-5,
                                                      heads_per_program=h, num_warps=w))
                  for h in (8, 16, 64) for w in (4, 8)]
        cases += [(f"swiglu block {b} w{w}", 3 * rows * FFN * 2, lambda b=b, w=w: swiglu.swiglu(up, block=b,
                                                                                             num_warps=w))
                  for b in (1024, 2048, 4096) for w in (4, 8)]
        if args.only_updates:
            cases = []
        if args.update_rank:
            cases += update_cases(rows, args.update_rank, up, q, k, weight[:DIM], cos, sin)
        for name, nbytes, fn in cases:
            ms = time_cuda(fn, repeat=20)
            table.append({"rows": rows, "kernel": name, "ms": f"{ms:.3f}", "GB/s": f"{nbytes / ms / 1e6:.0f}"})
    print_table(table, ["rows", "kernel", "ms", "GB/s"])


def update_cases(rows, rank, up, q, k, weight, cos, sin):
    """(name, bytes moved, call) for the update kernels and the adds they replace, at `rank`."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(rows, 3 * rank, **bf16)[:, rank : 2 * rank]  # a slice of a group's projection
    up_ffn, up_head = torch.randn(2 * FFN, rank, **bf16) * 0.01, torch.randn(HEADS * DIM, rank, **bf16) * 0.01
    ffn_rows, head_rows = up.view(rows, 2 * FFN), q.view(rows, HEADS * DIM)
    cases = [("add: addmm_ into the SwiGLU projection", 2 * rows * 2 * FFN * 2,
              lambda: ffn_rows.addmm_(hidden, up_ffn.t())),
             ("add: addmm_ into q and k", 2 * 2 * rows * HEADS * DIM * 2,
              lambda: (head_rows.addmm_(hidden, up_head.t()), k.view(rows, -1).addmm_(hidden, up_head.t())))]
    for fp8 in (False, True):
        # bf16: x read once, bf16 out; e4m3: x read twice (amax pass, then values), one byte out
        cases += [(f"swiglu{' fp8' if fp8 else ''} + update tile {m}x{n} w{w}", rows * FFN * (9 if fp8 else 6),
                   lambda m=m, n=n, w=w, fp8=fp8: swiglu.swiglu(
                       up, fp8=fp8, update=(hidden, up_ffn), update_blocks=(m, n), update_warps=w))
                  for m, n in ((64, 128), (128, 128), (64, 64), (32, 128)) for w in (4, 8)]
        cases += [(f"qk_norm_rope{' fp8' if fp8 else ''} + updates {m} rows w{w}", 4 * rows * HEADS * DIM * 2,
                   lambda m=m, w=w, fp8=fp8: rope.qk_norm_rope(
                       q, k, weight, weight, cos, sin, 1e-5, fp8=fp8, updates=((hidden, up_head), (hidden, up_head)),
                       num_warps=w, update_rows=m))
                  for m in (32, 64, 128) for w in (4, 8)]
    return cases


if __name__ == "__main__":
    main()
