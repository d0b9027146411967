"""Where a K3 decode step's time goes: the step of `bench_k3.py`'s mid config (CUDA graphs on a GPU) timed whole,
then with one kernel family at a time skipped. A skipped op returns an uninitialised buffer of its output's shape
and launches nothing, so the outputs are garbage and only the times mean something; the router is replaced by a
fixed routing in every variant after the first, so that garbage cannot change which experts' bytes are read.
The saving of a variant against the fixed-routing step is that family's marginal cost inside the chain of kernels,
which is what a change to it can win (isolated kernel timings overstate or understate it: in a chain a kernel
overlaps its neighbours' starts and ends).

    python benchmarks/k3_decode_breakdown.py [--batch 1] [--steps 48] [--tiny]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_k3

import h3gen.pipelines.k3.attention as k3_attention
import h3gen.pipelines.k3.layers as k3_layers
import h3gen.pipelines.k3.model as k3_model
import h3gen.pipelines.k3.moe as k3_moe
import h3gen.pipelines.k3.pending_norm as pending_norm
from h3gen.loading.load import keeps_fp32
from h3gen.pipelines.k3.demo_model import randomize
from h3gen.pipelines.k3.model import K3ForCausalLM

# The ops a variant may replace (restored before each variant), by name: in every module of the K3 model that reads
# them, and in those through which a decode step's norms reach the projection kernels (`PendingNorm`).
K3_MODULES = (k3_model, k3_layers, k3_attention, k3_moe)
MODEL_OPS = (
    "rms_norm",
    "kda_decode",
    "grouped_rows_linear",
    "absorb_query",
    "mla_decode",
    "mla_decode_partials",
    "absorb_output",
    "router_topk",
    "expert_swiglu_down",
    "rows_linear",
    "expert_gemv",
)
PATCHED = {module: tuple(name for name in MODEL_OPS if hasattr(module, name)) for module in K3_MODULES}
PATCHED[pending_norm] = ("add_rms_norm", "rms_norm", "rows_linear", "normed_rows_linear")


def everywhere(name: str, op) -> dict:
    """`op` in place of `name` in every K3 model module that reads it."""
    return {(module, name): op for module in K3_MODULES if hasattr(module, name)}


def fixed_router(num_experts: int):
    """A stand-in for `router_topk`: the same distinct experts per token every call (chosen once per shape, outside
    graph capture: the engine warms each graph up before capturing it), weight 0.1 each, no launch."""
    chosen = {}

    def route(h, weight, bias, top_k, *rest, residual=None):
        always = rest[-1] if rest else 0
        tokens = h.shape[0]
        key = (tokens, top_k, always, h.device)
        if key not in chosen:
            g = torch.Generator().manual_seed(tokens)
            ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
            ids = torch.cat([ids, torch.arange(num_experts, num_experts + always).expand(tokens, always)], 1)
            chosen[key] = (torch.full(ids.shape, 0.1, device=h.device), ids.to(h.device))
        weights, ids = chosen[key]
        return (h, h, weights, ids) if residual is not None else (weights, ids)

    return route


def skips() -> dict:
    """Each skipped family's replacement ops, by (module, name): outputs of the right shape, nothing launched (the
    norms computed in a projection's kernel: that projection without its norm prologue)."""

    def empty(*shape, dtype, like):
        return torch.empty(*shape, dtype=dtype, device=like.device)

    def unnormed_linear(x, norm_weight, eps, weight, residual=None):
        return x, pending_norm.rows_linear(x, weight)

    p = pending_norm
    return {
        "norms (separate, and in the projections' prologues)": {
            **everywhere("rms_norm", lambda x, w, e: x),
            (p, "rms_norm"): lambda x, w, e: x,
            (p, "add_rms_norm"): lambda x, y, w, e: (x, x),
            (p, "normed_rows_linear"): unnormed_linear,
        },
        "KDA decode": everywhere("kda_decode", lambda q, *a, **k: torch.empty_like(q)),
        "low-rank gate GEMV (above 4 rows)": everywhere(
            "grouped_rows_linear", lambda x, w: empty(x.shape[0], x.shape[1], w.shape[1], dtype=x.dtype, like=x)
        ),
        "MLA cache write + absorb + decode": {
            **everywhere(
                "absorb_query",
                lambda q, w, nope, new_rows=None: empty(
                    q.shape[0], q.shape[1], w.shape[-1] + q.shape[-1] - nope, dtype=torch.float32, like=q
                ),
            ),
            **everywhere(
                "mla_decode",
                lambda q, pages, table, lens, scale, v: empty(q.shape[0], q.shape[1], v, dtype=torch.float32, like=q),
            ),
            **everywhere(
                "mla_decode_partials",
                lambda q, pages, table, lens, scale, v, splits: (
                    empty(q.shape[0], q.shape[1], splits, v, dtype=torch.float32, like=q),
                    empty(q.shape[0], q.shape[1], splits, dtype=torch.float32, like=q),
                ),
            ),
            **everywhere(
                "absorb_output",
                lambda latent, w_vc, dtype, gate=None, lse=None: empty(
                    latent.shape[0], w_vc.shape[0], w_vc.shape[1], dtype=dtype, like=latent
                ),
            ),
        },
        "expert SwiGLU + down tail": everywhere(
            "expert_swiglu_down",
            lambda both, down, ids, w, add=None: empty(ids.shape[0], down.shape[1], dtype=both.dtype, like=both),
        ),
        "expert gate/up GEMV": everywhere(
            "expert_gemv",
            lambda x, w, ids, top_k=1, always=0, out=None: empty(ids.numel(), w.shape[1], dtype=x.dtype, like=x),
        ),
        "few-row GEMVs (rows_linear, normed_rows_linear)": {
            **everywhere("rows_linear", lambda x, w: empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, like=x)),
            (p, "rows_linear"): lambda x, w: empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, like=x),
            (p, "normed_rows_linear"): lambda x, nw, e, w, residual=None: (
                x,
                empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, like=x),
            ),
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run (best of two runs)")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke run)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    tiny = args.tiny or device.type == "cpu"
    config = bench_k3.mid_config(tiny)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=device), seed=0).to(torch.float32 if tiny else torch.bfloat16).eval()
    for name, param in model.named_parameters():
        if keeps_fp32(name, K3ForCausalLM.keep_fp32_modules):
            param.data = param.data.float()
    originals = {(module, name): getattr(module, name) for module, names in PATCHED.items() for name in names}
    fixed = everywhere("router_topk", fixed_router(config.num_experts))
    variants = [("full step", {}), ("fixed routing (the base; router kernel skipped)", fixed)]
    variants += [(f"no {family}", {**fixed, **ops}) for family, ops in skips().items()]
    options = dict(page_size=16 if tiny else 64, chunk_size=64 if tiny else 2048, max_context=2048)
    rows = []
    try:
        for label, ops in variants:
            for (module, name), op in [*originals.items(), *ops.items()]:
                setattr(module, name, op)
            times = [
                args.batch
                * 1e3
                / bench_k3.decode_rate(model, args.batch, 128, args.steps, device, cuda_graphs=None, **options)[0]
                for _ in range(2)
            ]
            rows.append((label, min(times)))
            print(f"{label}: {min(times):.4f} ms per step", flush=True)
    finally:
        for (module, name), op in originals.items():
            setattr(module, name, op)
    base = rows[1][1]
    print(
        f"\nbatch {args.batch}, {'tiny' if tiny else 'mid'} config on {device.type}; saved = fixed-routing step - "
        "variant (the first row's saving is the router's)"
    )
    print(f"{'variant':55s} {'ms per step':>12s} {'saved us':>9s}")
    for label, ms in rows:
        print(f"{label:55s} {ms:12.4f} {(base - ms) * 1e3:+9.1f}")


if __name__ == "__main__":
    main()
