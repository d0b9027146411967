"""MiniMax-H3 blocks on N GPUs of one host, under torchrun (one process per GPU).

Scaling (default): N full-size blocks over the packed sequence of a 5 s 768x1344 request (37,838 rows), run as
Ulysses N, TP N and every TP x Ulysses split of N, against the same blocks on one GPU (each rank runs the one-GPU
forward on its own GPU first). Prints per layout: forward time, scaling efficiency (one-GPU time / (N x time)),
per-GPU weights and peak memory, and the error of the gathered output against the one-GPU output. xfuser's
Ulysses (its sequence-parallel core, yunchang's `LongContextAttention`, ring degree 1) runs on the same blocks as a
baseline when `yunchang` imports, next to ours with the same attention kernel (cuDNN).

Workstation (`--workstation`): the two-GPU machine of 2 x 32 GB, simulated by capping each GPU's memory: the whole
50-block stack, Ulysses N, layer-wise offload whose residency comes from the planner for `--gpu-memory`, all ranks
streaming from one pinned host copy in shared memory. Prints the step (all blocks) time against the same stack
all-resident (uncapped), peak GPU memory per rank and the host memory held.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --rows 37838 --blocks 8
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --workstation --blocks 50 --gpu-cap-gib 32
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --device cpu --tiny   # CPU smoke run (gloo)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helper that fills TP shards
from common import print_table, rel_l2, time_cuda
from helpers.parallel_model import load_full_state_dict

from h3gen.linear import dense_linear, make_linear_factory
from h3gen.offload.apply import ON_DEMAND
from h3gen.offload.layerwise import LayerwiseOffload, owned_tensors
from h3gen.offload.residency import parse_bytes, plan_residency
from h3gen.offload.shared_host import shared_store_for_ranks
from h3gen.parallel.state import init_parallel, valid_degrees
from h3gen.parallel.ulysses import SequenceShard, UlyssesAttention
from h3gen.pipelines.h3.packing import build_layout, row_timesteps
from h3gen.pipelines.h3.tiers import fused_block_forward
from h3gen.pipelines.h3.transformer_blocks import H3RotaryPosEmbed, H3TransformerBlock
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig

GiB = 2**30
TINY = H3TransformerConfig(
    num_attention_heads=8, attention_head_dim=16, hidden_size=48, ffn_dim=80, time_embed_dim=24, rope_freq_dim=2
)
PARITY_REL_L2 = 1e-2  # bf16 tolerance for "equal to one GPU" (bf16 epsilon is 7.8e-3)


# ---------------------------------------------------------------------------------------------------- set-up


def make_inputs(cfg: H3TransformerConfig, rows: int, device, dtype):
    """A real 5 s 768x1344 t2va layout truncated to `rows`: the residual stream `(1, rows, hidden)`, the AdaLN
    timestep embeddings `(K, time_embed_dim)`, the per-row AdaLN indices `(rows,)` and rotary `(cos, sin)`."""
    layout = build_layout(128, 37, 48, 84, 207)
    if rows > layout.position_ids.shape[0]:
        raise SystemExit(f"--rows can be at most {layout.position_ids.shape[0]}")
    timestep, indices = row_timesteps(layout, 0.37, 0.61, 0.999)
    positions = layout.position_ids[:rows].to(device)
    adaln_indices = (indices * 3 + layout.token_tags)[:rows].to(device)
    cos, sin = H3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(device)(positions)
    generator = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(1, rows, cfg.hidden_size, device=device, dtype=dtype, generator=generator)
    temb = torch.randn(timestep.numel(), cfg.time_embed_dim, device=device, generator=generator)
    return x, temb, adaln_indices, (cos, sin)


def build_blocks(cfg, count: int, device, dtype) -> nn.ModuleList:
    """`count` random full blocks, the same on every rank (seeded), with the lossless tier's fused forward."""
    torch.manual_seed(0)
    blocks = nn.ModuleList()
    for _ in range(count):
        with torch.device(device):
            block = H3TransformerBlock(cfg, dense_linear)
        with torch.no_grad():  # non-trivial norm weights
            for name, param in block.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.1)
        block = block.to(dtype).eval()
        block.fused_forward = fused_block_forward
        blocks.append(block)
    return blocks


def shard_blocks(
    full: nn.ModuleList, cfg, state, shard: SequenceShard | None, device, dtype, backend: str, core_factory=None
) -> nn.ModuleList:
    """This rank's TP shards of `full` (Ulysses attention cores when sp > 1, or `core_factory()`'s)."""
    blocks = nn.ModuleList()
    for source in full:
        with torch.device("meta"):
            block = H3TransformerBlock(cfg, make_linear_factory(parallel=state))
        block = block.to_empty(device=device).to(dtype)
        load_full_state_dict(block, source.state_dict())
        block.eval().fused_forward = fused_block_forward
        if core_factory is not None:
            block.attn.core = core_factory()
        elif state.sp > 1:
            block.attn.core = UlyssesAttention(state, shard, backend=backend)
        else:
            block.attn.core.backend = backend
        blocks.append(block)
    return blocks


def forward(blocks, x, tables, idx, rope):
    for block, table in zip(blocks, tables, strict=False):
        x = block(x, None, idx, rope, modulation=table)
    return x


def local_rows(t: torch.Tensor, dim: int, shard: SequenceShard, sp_rank: int) -> torch.Tensor:
    """This rank's contiguous slice of the sequence, padded (trailing zeros) to a multiple of sp."""
    missing = shard.padded - t.shape[dim]
    if missing:
        pad = torch.zeros(*t.shape[:dim], missing, *t.shape[dim + 1 :], dtype=t.dtype, device=t.device)
        t = torch.cat([t, pad], dim=dim)
    return t.narrow(dim, sp_rank * shard.local, shard.local)


def gather_rows(x: torch.Tensor, state, valid: int) -> torch.Tensor:
    if state.sp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.sp)]
    dist.all_gather(parts, x.contiguous(), group=state.sp_group)
    return torch.cat(parts, dim=1)[:, :valid]


# ---------------------------------------------------------------------------------------------------- timing


def timed(fn, x: torch.Tensor, repeat: int, device) -> float:
    """Median ms of `fn(work)` where `work` is restored to `x` before each run (the fused blocks update the
    residual stream in place); every rank enters each run together."""
    work = x.clone()

    def setup():
        work.copy_(x)
        dist.barrier()

    if device.type == "cuda":
        return time_cuda(lambda: fn(work), warmup=2, repeat=repeat, setup=setup)
    times = []
    for i in range(repeat + 1):
        setup()
        start = time.perf_counter()
        fn(work)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def slowest(value: float) -> float:
    """The largest `value` over all ranks (a step is as slow as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else float("nan")


# ---------------------------------------------------------------------------------------------------- runs


def xfuser_core_factory(world: int, rank: int, head_dim: int, cuda: bool):
    """xfuser's sequence-parallel attention (yunchang's `LongContextAttention`, Ulysses `world`, ring 1, cuDNN
    attention; torch's math attention on a CPU) as an attention core, or None when yunchang does not import."""
    try:
        from yunchang import LongContextAttention, set_seq_parallel_pg
        from yunchang.kernels import AttnType
    except Exception as error:  # any import failure means "baseline not available"
        print(f"xfuser baseline skipped: yunchang does not import ({error})", flush=True)
        return None
    set_seq_parallel_pg(world, 1, rank, world)

    class XfuserCore(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = LongContextAttention(attn_type=AttnType.TORCH_CUDNN if cuda else AttnType.TORCH_MATH)

        def forward(self, query, key, value):
            return self.attention(query, key, value, softmax_scale=head_dim**-0.5)

    return XfuserCore


def run_scaling(args, cfg, device, dtype, world: int, rank: int) -> list[dict]:
    x, temb, idx, rope = make_inputs(cfg, args.rows, device, dtype)
    full = build_blocks(cfg, args.blocks, device, dtype)
    for block in full:
        block.attn.core.backend = args.backend
    with torch.no_grad():
        tables = [block.adaln_proj.table(temb) for block in full]
        expected = forward(full, x.clone(), tables, idx, rope)
        reset_peak(device)
        one_ms = slowest(timed(lambda h: forward(full, h, tables, idx, rope), x, args.repeat, device))
        one_peak = peak_gib(device)
    full_gib = weight_bytes(full) / GiB
    full.cpu()
    rows = [
        {
            "layout": "1 GPU",
            "ms": f"{one_ms:.1f}",
            "efficiency": "-",
            "weights GiB/GPU": f"{full_gib:.2f}",
            "peak GiB/GPU": f"{one_peak:.2f}",
            "relL2 vs 1 GPU": "0",
            "max abs": "0",
        }
    ]

    layouts = [(tp, sp) for tp, sp in valid_degrees(cfg.num_attention_heads, world) if tp * sp == world]
    variants = [
        (
            f"Ulysses {sp}" if tp == 1 else f"TP {tp}" if sp == 1 else f"TP {tp} x Ulysses {sp}",
            tp,
            sp,
            args.backend,
            None,
        )
        for tp, sp in layouts
    ]
    if args.xfuser and world > 1 and (1, world) in layouts:
        if args.rows % world:
            print(
                f"xfuser baseline skipped: {args.rows} rows do not split evenly over {world} ranks and "
                "LongContextAttention has no padding support",
                flush=True,
            )
        else:
            cuda = device.type == "cuda"
            factory = xfuser_core_factory(world, rank, cfg.attention_head_dim, cuda)
            kernel, same = ("cuDNN", "cudnn") if cuda else ("math", "sdpa")
            if factory is not None:
                variants.append((f"Ulysses {world}, ours, {kernel} attention", 1, world, same, None))
                variants.append((f"Ulysses {world}, xfuser (yunchang), {kernel} attention", 1, world, same, factory))
    for name, tp, sp, backend, core_factory in variants:
        state = init_parallel(tp, sp, cfg.num_attention_heads)
        shard = SequenceShard(sp)
        shard.valid, shard.padded = args.rows, -(-args.rows // sp) * sp
        blocks = shard_blocks(full, cfg, state, shard, device, dtype, backend, core_factory)
        with torch.no_grad():
            tables = [block.adaln_proj.table(temb) for block in blocks]
            x_local, idx_local = local_rows(x, 1, shard, state.sp_rank), local_rows(idx, 0, shard, state.sp_rank)
            rope_local = tuple(local_rows(t, 0, shard, state.sp_rank) for t in rope)
            got = gather_rows(forward(blocks, x_local.clone(), tables, idx_local, rope_local), state, args.rows)
            reset_peak(device)
            ms = slowest(
                timed(lambda h: forward(blocks, h, tables, idx_local, rope_local), x_local, args.repeat, device)
            )
            peak = slowest(peak_gib(device))
        error = slowest(rel_l2(got, expected))
        rows.append(
            {
                "layout": name,
                "ms": f"{ms:.1f}",
                "efficiency": f"{one_ms / (world * ms):.1%}",
                "weights GiB/GPU": f"{weight_bytes(blocks) / GiB:.2f}",
                "peak GiB/GPU": f"{peak:.2f}",
                "relL2 vs 1 GPU": f"{error:.1e}" + ("" if error <= PARITY_REL_L2 else " (over bf16 tolerance)"),
                "max abs": f"{slowest((got.float() - expected.float()).abs().max().item()):.1e}",
            }
        )
        blocks = None  # free this layout's shards before the next
        reset_peak(device)
    return rows


def run_workstation(args, cfg, device, dtype, world: int, rank: int) -> list[dict]:
    """Ulysses `world` over the whole stack: all-resident (uncapped), then capped + layer-wise offload from one
    shared host copy."""
    state = init_parallel(1, world, cfg.num_attention_heads)
    shard = SequenceShard(world)
    shard.valid, shard.padded = args.rows, -(-args.rows // world) * world
    x, temb, idx, rope = make_inputs(cfg, args.rows, device, dtype)
    x_local, idx_local = local_rows(x, 1, shard, state.sp_rank), local_rows(idx, 0, shard, state.sp_rank)
    rope_local = tuple(local_rows(t, 0, shard, state.sp_rank) for t in rope)
    blocks = build_blocks(cfg, args.blocks, device, dtype)
    for block in blocks:
        block.attn.core = UlyssesAttention(state, shard, backend=args.backend)
    stack_gib = weight_bytes(blocks) / GiB
    with torch.no_grad():
        tables = [block.adaln_proj.table(temb) for block in blocks]
        expected = forward(blocks, x_local.clone(), tables, idx_local, rope_local)
        reset_peak(device)
        resident_ms = slowest(
            timed(lambda h: forward(blocks, h, tables, idx_local, rope_local), x_local, args.repeat, device)
        )
        resident_peak = slowest(peak_gib(device))
    del tables

    # Residency as the product plans it (`apply_layerwise_offload`): a fifth of the budget for activations, the
    # AdaLN projections out of the per-step stream.
    budget = parse_bytes(args.gpu_memory)
    block_bytes = [sum(t.numel() * t.element_size() for *_, t in owned_tensors(b, ON_DEMAND)) for b in blocks]
    plan = plan_residency(block_bytes, budget - budget // 5, prefetch=args.prefetch)
    store_bytes = sum(weight_bytes(b) for b in blocks)
    store = shared_store_for_ranks("bench-parallel-blocks", store_bytes, pin=device.type == "cuda")
    shmem_before = meminfo_gib("Shmem")
    start = time.perf_counter()
    offload = LayerwiseOffload(blocks, plan, device, prefetch=args.prefetch, on_demand=ON_DEMAND, host_store=store)
    pack_s = time.perf_counter() - start
    dist.barrier()
    shmem = meminfo_gib("Shmem") - shmem_before
    reset_peak(device)
    if device.type == "cuda" and args.gpu_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GiB / total), device)
    with torch.no_grad():
        start = time.perf_counter()
        tables = [block.adaln_proj.table(temb) for block in blocks]  # once per request (weights copied on demand)
        if device.type == "cuda":
            torch.cuda.synchronize()
        tables_ms = slowest((time.perf_counter() - start) * 1e3)
        got = forward(blocks, x_local.clone(), tables, idx_local, rope_local)
        offload_ms = slowest(
            timed(lambda h: forward(blocks, h, tables, idx_local, rope_local), x_local, args.repeat, device)
        )
        offload_peak = slowest(peak_gib(device))
    exact = slowest(float(not torch.equal(got, expected))) == 0
    shared = "one shared copy" if store is not None else f"{world} per-rank copies"
    host = f"{offload.pinned_bytes / GiB:.1f} ({shared}; Shmem +{shmem:.1f})"
    rows = [
        {
            "run": f"Ulysses {world}, {args.blocks} blocks all resident",
            "ms": f"{resident_ms:.0f}",
            "x resident": "1.000",
            "peak GiB/GPU": f"{resident_peak:.1f}",
            "host GiB": "-",
            "output": "reference",
        },
        {
            "run": f"Ulysses {world}, GPU capped at {args.gpu_cap_gib} GiB, {len(plan.resident)} resident + "
            f"{len(plan.streamed)} streamed (planned for {args.gpu_memory})",
            "ms": f"{offload_ms:.0f}",
            "x resident": f"{offload_ms / resident_ms:.3f}",
            "peak GiB/GPU": f"{offload_peak:.1f}",
            "host GiB": host,
            "output": "bit-identical" if exact else f"relL2 {rel_l2(got, expected):.1e}",
        },
    ]
    if rank == 0:
        print(
            f"stack {stack_gib:.1f} GiB; packing the host store took {pack_s:.1f} s; AdaLN tables for the request "
            f"(AdaLN weights copied on demand) {tables_ms:.0f} ms",
            flush=True,
        )
    offload.remove()
    return rows


def meminfo_gib(field: str) -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=37838)
    parser.add_argument("--blocks", type=int, default=None, help="default 8 (scaling) or 50 (workstation)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backend", default="auto", help="attention backend of our runs (auto: FA3 when installed)")
    parser.add_argument("--no-xfuser", dest="xfuser", action="store_false")
    parser.add_argument("--workstation", action="store_true")
    parser.add_argument("--gpu-cap-gib", type=float, default=32.0)
    parser.add_argument("--gpu-memory", default="30GiB", help="the offload budget the planner is given")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (for a CPU smoke run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.blocks is None:
        args.blocks = 50 if args.workstation else 8

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    cfg = TINY if args.tiny else H3TransformerConfig()
    if args.workstation and args.tiny:
        args.gpu_memory = args.gpu_memory if args.gpu_memory != "30GiB" else "1MiB"
    rows = (run_workstation if args.workstation else run_scaling)(args, cfg, device, dtype, world, rank)
    if rank == 0:
        print(
            f"\n{world} x {torch.cuda.get_device_name(device) if cuda else 'CPU'}, {args.rows} rows, "
            f"{args.blocks} blocks, {'bf16' if cuda else 'fp32'}",
            flush=True,
        )
        print_table(rows, list(rows[0]))
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
