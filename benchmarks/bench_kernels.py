"""Launch configurations of the row kernels at H3 shapes (hidden 5376, 56 heads x 128, SwiGLU 14336), to pick the
defaults: time and achieved bandwidth per config, best first per kernel. With `--lora-rank R`, also how the
block's linears best take a rank-R LoRA update (see `lora_cases`).

    python benchmarks/bench_kernels.py --rows 8192 37838 [--lora-rank 128 [--only-lora]] [--rounds 3]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, time_cuda

from h3gen.kernels.gated_residual import triton as residual
from h3gen.kernels.norm_modulate import triton as norm
from h3gen.kernels.qk_norm_rope import triton as rope
from h3gen.kernels.swiglu import triton as swiglu

HIDDEN, HEADS, DIM, FFN = 5376, 56, 128, 14336


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 37838])
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also time the dense linear with a LoRA update of this rank both ways (0: skip)",
    )
    parser.add_argument("--only-lora", action="store_true", help="time only the LoRA cases")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every case this many times, in turn; the median is printed, with the spread (max - min)",
    )
    args = parser.parse_args()
    table = []
    for rows in args.rows:
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, y = torch.randn(1, rows, HIDDEN, **bf16), torch.randn(1, rows, HIDDEN, **bf16)
        weight, tab = torch.randn(HIDDEN, **bf16), torch.randn(6, 6 * HIDDEN, **bf16)
        shift, scale, gate = tab[:, :HIDDEN], tab[:, HIDDEN : 2 * HIDDEN], tab[:, 2 * HIDDEN : 3 * HIDDEN]
        index = torch.randint(0, 6, (rows,), device="cuda")
        q, k = torch.randn(1, rows, HEADS, DIM, **bf16), torch.randn(1, rows, HEADS, DIM, **bf16)
        cos, sin = torch.randn(rows, 96, device="cuda"), torch.randn(rows, 96, device="cuda")
        up = torch.randn(1, rows, 2 * FFN, **bf16)
        row = rows * HIDDEN * 2
        cases = [
            (
                f"rmsnorm_modulate w{w}",
                2 * row,
                lambda w=w: norm.rmsnorm_modulate(x, weight, shift, scale, index, 1e-5, num_warps=w),
            )
            for w in (4, 8, 16)
        ]
        cases += [
            (
                f"gated_residual_norm_modulate w{w}",
                4 * row,
                lambda w=w: residual.gated_residual_norm_modulate(
                    x, y, gate, index, weight, shift, scale, 1e-5, num_warps=w
                ),
            )
            for w in (4, 8, 16)
        ]
        cases += [
            (f"gated_residual w{w}", 3 * row, lambda w=w: residual.gated_residual(x, y, gate, index, num_warps=w))
            for w in (4, 8, 16)
        ]
        cases += [
            (
                f"qk_norm_rope {h} heads/program w{w}",
                4 * rows * HEADS * DIM * 2,
                lambda h=h, w=w: rope.qk_norm_rope(
                    q, k, weight[:DIM], weight[:DIM], cos, sin, 1e-5, heads_per_program=h, num_warps=w
                ),
            )
            for h in (8, 16, 64)
            for w in (4, 8)
        ]
        cases += [
            (f"swiglu block {b} w{w}", 3 * rows * FFN * 2, lambda b=b, w=w: swiglu.swiglu(up, block=b, num_warps=w))
            for b in (1024, 2048, 4096)
            for w in (4, 8)
        ]
        if args.only_lora:
            cases = []
        if args.lora_rank:
            cases += lora_cases(rows, args.lora_rank)
        # Every case once per round, in turn, so that a drift of the clocks between rounds reaches all of them.
        times = {name: [] for name, _, _ in cases}
        for _ in range(args.rounds):
            for name, _, fn in cases:
                times[name].append(time_cuda(fn, repeat=40))
        for name, nbytes, _ in cases:
            ms = statistics.median(times[name])
            table.append(
                {
                    "rows": rows,
                    "kernel": name,
                    "ms": f"{ms:.3f}",
                    "spread ms": f"{max(times[name]) - min(times[name]):.3f}",
                    "GB/s": f"{nbytes / ms / 1e6:.0f}",
                }
            )
    print_table(table, ["rows", "kernel", "ms", "spread ms", "GB/s"])


def lora_cases(rows, rank):
    """(name, output bytes written or read, call) for the block's linears with a rank-`rank` update, bf16 (each
    case with its A product `x A^T` included): the linear alone, the update added after the GEMM (`addmm_`),
    written first with the GEMM adding into it (beta = 1), and K-extended (the update inside the GEMM's K loop: the
    A product written into the input's last columns, then one GEMM of `[x | x A^T]` by `[W | scale B]`); q's shape
    also K-extended by 2 and 3 ranks (k and v of a group whose members have A's of their own read the columns of
    those before them) and through cuBLASLt; q, k and v together as three linears or as one of 3 x 7168 outputs;
    FP8 (e4m3, per-row / per-column scales, no matrix to add into; A product not included) alone, with the update
    added after, and as one K-extended GEMM of e4m3 operands."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    mm = torch.nn.functional.linear
    cases = []

    def operands(n, k, extra):
        x_wide = torch.randn(rows, k + extra, **bf16)
        w_wide = torch.randn(n, k + extra, **bf16) * 0.02
        down = torch.randn(extra, k, **bf16) / k**0.5
        return x_wide, w_wide, down

    def k_extended(x_wide, w_wide, down):
        k = x_wide.shape[1] - down.shape[0]
        torch.mm(x_wide[:, :k], down.t(), out=x_wide[:, k:])
        return mm(x_wide, w_wide)

    def update_first(x, w, down, up):
        return torch.mm(mm(x, down), up.t()).addmm_(x, w.t())

    def lt(fn):  # the call through cuBLASLt, the preference restored afterwards
        def call():
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                return fn()
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")

        return call

    shapes = (
        ("q", HEADS * DIM, HIDDEN),
        ("to_out", HIDDEN, HEADS * DIM),
        ("SwiGLU projection", 2 * FFN, HIDDEN),
        ("ff.net.2", HIDDEN, FFN),
    )
    for name, n, k in shapes:
        x_wide, w_wide, down = operands(n, k, rank)
        x, w = x_wide[:, :k].contiguous(), w_wide[:, :k].contiguous()
        up = torch.randn(n, rank, **bf16) * 0.01
        out = rows * n * 2
        cases += [
            (f"{name}: linear alone", out, lambda x=x, w=w: mm(x, w)),
            (
                f"{name}: linear, then addmm_ of the update",
                3 * out,
                lambda x=x, w=w, d=down, u=up: mm(x, w).addmm_(mm(x, d), u.t()),
            ),
            (
                f"{name}: update first, linear adds into it",
                2 * out,
                lambda x=x, w=w, d=down, u=up: update_first(x, w, d, u),
            ),
            (f"{name}: K-extended by {rank}", out, lambda a=(x_wide, w_wide, down): k_extended(*a)),
            (f"{name}: the A product alone (by {rank})", rows * rank * 2, lambda x=x, d=down: mm(x, d)),
        ]
        if name == "q":
            for ranks in (2, 3):
                wide = operands(n, k, ranks * rank)
                cases.append((f"q: K-extended by {ranks * rank}", out, lambda a=wide: k_extended(*a)))
            cases += [
                ("q: cuBLASLt linear alone", out, lt(lambda x=x, w=w: mm(x, w))),
                ("q: cuBLASLt update first", 2 * out, lt(lambda x=x, w=w, d=down, u=up: update_first(x, w, d, u))),
                (f"q: cuBLASLt K-extended by {rank}", out, lt(lambda a=(x_wide, w_wide, down): k_extended(*a))),
            ]
            x3, w3, down3 = operands(3 * n, k, 3 * rank)
            ups = [torch.randn(n, rank, **bf16) * 0.01 for _ in range(3)]
            ws = [w3[i * n : (i + 1) * n, :k].contiguous() for i in range(3)]
            x3k = x3[:, :k].contiguous()

            def three_first(x=x3k, ws=ws, d=down3, ups=ups):
                hidden = mm(x, d)
                return [
                    torch.mm(hidden[:, i * rank : (i + 1) * rank], u.t()).addmm_(x, w.t())
                    for i, (w, u) in enumerate(zip(ws, ups, strict=False))
                ]

            def three_wide(x_wide=x3, w_wide=w3, d=down3, n=n, k=k):
                torch.mm(x_wide[:, :k], d.t(), out=x_wide[:, k:])
                return [
                    mm(x_wide[:, : k + (i + 1) * rank], w_wide[i * n : (i + 1) * n, : k + (i + 1) * rank])
                    for i in range(3)
                ]

            x4 = torch.randn(rows, k + 4 * rank, **bf16)  # [x A_q^T | x | x A_k^T | x A_v^T | spare]
            w_q = torch.cat([up, ws[0]], dim=1)
            w_kv = [torch.cat([ws[1], ups[1]], dim=1), torch.cat([ws[2], torch.zeros_like(ups[2]), ups[2]], dim=1)]

            def three_left_right(x_wide=x4, d=down3, k=k, w_q=w_q, w_kv=w_kv):
                # one A product into [x A_k^T | x A_v^T | x A_q^T] right of x, x A_q^T then copied left of it
                torch.mm(x_wide[:, rank : rank + k], d.t(), out=x_wide[:, rank + k :])
                x_wide[:, :rank].copy_(x_wide[:, 3 * rank + k :])
                return [
                    mm(x_wide[:, : rank + k], w_q),
                    mm(x_wide[:, rank : 2 * rank + k], w_kv[0]),
                    mm(x_wide[:, rank : 3 * rank + k], w_kv[1]),
                ]

            cases += [
                ("q, k, v: three K-extended (by 1, 1, 2 ranks: q's columns left of x)", 3 * out, three_left_right),
                (f"q, k, v: the A product alone (by {3 * rank})", rows * 3 * rank * 2, lambda x=x3k, d=down3: mm(x, d)),
            ]
            shared = operands(3 * n, k, rank)
            w3k = w3[:, :k].contiguous()
            cases += [
                ("q, k, v: three linears alone", 3 * out, lambda x=x3k, ws=ws: [mm(x, w) for w in ws]),
                ("q, k, v: three, each update first", 6 * out, three_first),
                ("q, k, v: three K-extended (by 1, 2, 3 ranks)", 3 * out, three_wide),
                ("q, k, v: one linear alone", 3 * out, lambda x=x3k, w=w3k: mm(x, w)),
                (f"q, k, v: one K-extended by {3 * rank}", 3 * out, lambda a=(x3, w3, down3): k_extended(*a)),
                (f"q, k, v: one K-extended by {rank} (a shared A)", 3 * out, lambda a=shared: k_extended(*a)),
            ]
        if hasattr(torch, "_scaled_mm"):
            e4m3 = torch.float8_e4m3fn
            xq, wq = x_wide.to(e4m3), w_wide.to(e4m3)
            xs, ws = torch.rand(rows, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
            x8, w8 = xq[:, :k].contiguous(), wq[:, :k].contiguous()
            hidden = torch.randn(rows, rank, **bf16)

            def scaled(a, b, xs=xs, ws=ws):
                return torch._scaled_mm(a, b.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

            cases += [
                (f"{name}: FP8 alone", out, lambda a=x8, b=w8, f=scaled: f(a, b)),
                (
                    f"{name}: FP8, then addmm_ of the update",
                    3 * out,
                    lambda a=x8, b=w8, h=hidden, u=up, f=scaled: f(a, b).addmm_(h, u.t()),
                ),
                (f"{name}: FP8 K-extended GEMM", out, lambda a=xq, b=wq, f=scaled: f(a, b)),
            ]
    return cases


if __name__ == "__main__":
    main()
