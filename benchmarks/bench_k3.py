"""K3 engine throughput on a mid-size random config: decode tokens/s at batch 1, 8 and 32 (greedy; batch 1 also
sampled as the planner samples) against the weight-bytes / bandwidth roofline, prefill tokens/s, and time to first
token with and without a cached 4k-token system prompt. The reference is the model's own `generate` (no engine) at batch
1: both run in this process on the same prompt, must give the same greedy tokens, and are timed the same way.

    python benchmarks/bench_k3.py                 # CUDA, mid-size config (bf16)
    python benchmarks/bench_k3.py --tiny          # CPU smoke run on a tiny config (fp32)
    H3GEN_FLA=1 python benchmarks/bench_k3.py --check   # fla's KDA prefill kernel, checked against the reference
    python benchmarks/bench_k3.py --check --mxfp4-experts   # routed experts in MXFP4, as K3 ships them
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table

from h3gen.loading.load import keeps_fp32
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.demo_model import randomize
from h3gen.pipelines.k3.engine import K3Engine, SamplingParams
from h3gen.pipelines.k3.model import K3ForCausalLM, quantize_experts_mxfp4

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e nominal; the script also measures a device copy


def mid_config(tiny: bool) -> K3Config:
    if tiny:
        layers = 4
        return K3Config(
            model_type="kimi_linear",
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=layers,
            attention_types=["kda", "kda", "kda", "mla"],
            ffn_types=["dense"] + ["moe"] * 3,
            num_attention_heads=2,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            linear_num_heads=2,
            linear_head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            eos_token_id=1,
        )
    layers = 16  # KDA : MLA = 3 : 1, as K3
    return K3Config(
        model_type="kimi_linear",
        vocab_size=32768,
        hidden_size=2048,
        num_hidden_layers=layers,
        attention_types=["mla" if i % 4 == 3 else "kda" for i in range(layers)],
        ffn_types=["dense"] + ["moe"] * (layers - 1),
        num_attention_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        linear_num_heads=16,
        linear_head_dim=128,
        intermediate_size=8192,
        moe_intermediate_size=768,
        num_experts=64,
        num_experts_per_token=6,
        num_shared_experts=1,
        eos_token_id=1,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measured_bandwidth(device) -> float:
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def decode_bytes(model: K3ForCausalLM, batch: int) -> float:
    """Weight bytes one decode step must read: everything but the routed experts, plus the distinct experts a batch
    of `batch` tokens is expected to touch per MoE layer (uniform routing)."""
    config = model.config
    total = expert = 0
    for name, param in itertools.chain(model.named_parameters(), model.named_buffers()):  # MXFP4 bytes are buffers
        size = param.numel() * param.element_size()
        if name == "model.embed_tokens.weight":
            continue  # a gather, not a read of the table
        total += size
        if ".experts." in name:
            expert += size
    if not config.num_experts:
        return total
    per_expert = expert / (config.num_experts * config.ffn_types.count("moe"))
    touched = config.num_experts * (1 - (1 - config.num_experts_per_token / config.num_experts) ** batch)
    return total - expert + per_expert * touched * config.ffn_types.count("moe")


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(count)]


# What a planner samples with (pipelines/k3/planner.py defaults), for the sampled decode row.
PLANNER_SAMPLING = dict(temperature=0.6, top_p=0.95)


def decode_rate(
    model, batch, prompt_len, steps, device, sampled=False, **engine_options
) -> tuple[float, list[list[int]]]:
    """Tokens/s of decode steps alone, with `batch` requests decoding together (`steps` steps in a row), greedy or
    (`sampled`) drawing as the planner does, with fixed seeds."""
    engine = K3Engine(model, max_batch=batch, prefix_cache=False, **engine_options)
    # Enough tokens that the first request still decodes when the last one's prefill is done.
    budget = steps + 4 + batch * -(-prompt_len // engine.prefill_budget)
    choice = dict(PLANNER_SAMPLING) if sampled else dict(temperature=0.0)
    requests = [
        engine.add_request(p, SamplingParams(max_tokens=budget, ignore_eos=True, seed=i if sampled else None, **choice))
        for i, p in enumerate(prompts(batch, prompt_len, model.config.vocab_size, seed=batch))
    ]
    while any(r.status != "decode" for r in requests):
        engine.step()
        errors = [r.error for r in requests if r.error]
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
    for _ in range(3):  # the batch's decode graph is captured in the first of these
        engine.step()
    # Steps back to back, synchronised only at the ends: the engine launches each greedy step before reading the
    # previous one's tokens, which a synchronisation after every step would undo.
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - start
    outputs = [list(r.output_ids) for r in requests]
    for request in requests:
        engine.abort(request)
    return batch * steps / elapsed, outputs


def reference_rate(model, prompt, steps, device) -> tuple[float, list[int]]:
    """The model's own generate (one sequence, its plain cache): decode tokens/s from two runs' difference."""
    ids = torch.tensor([prompt], device=device)

    def run(n):
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, n)
        sync(device)
        return time.perf_counter() - start, out[0].tolist()

    run(2)
    short, _ = run(2)
    long, tokens = run(steps + 4)
    return (steps + 2) / max(long - short, 1e-9), tokens


def prefill_rate(model, length, device, chunk) -> float:
    engine = K3Engine(
        model, max_batch=1, prefix_cache=False, chunk_size=chunk, prefill_budget=length, max_context=length + 8
    )
    prompt = prompts(1, length, model.config.vocab_size, seed=7)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # warm-up
    sync(device)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(device)
    return length / (time.perf_counter() - start)


def time_to_first_token(model, system_len, user_len, device, chunk) -> tuple[float, float, int]:
    """TTFT of system + user prompts: cold (empty cache) and warm (the system prompt cached by an earlier request
    with another user part). Returns (cold s, warm s, tokens taken from the cache)."""
    engine = K3Engine(
        model,
        max_batch=4,
        chunk_size=chunk,
        prefill_budget=system_len + user_len,
        max_context=system_len + user_len + 8,
    )
    system = prompts(1, system_len, model.config.vocab_size, seed=11)[0]
    users = prompts(3, user_len, model.config.vocab_size, seed=12)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt):
        sync(device)
        start = time.perf_counter()
        engine.generate([prompt], params)
        sync(device)
        return time.perf_counter() - start

    ttft(system + users[2])  # warm-up of kernels
    engine.cache.clear()
    cold = ttft(system + users[0])
    before = engine.stats["cached_tokens"]
    warm = ttft(system + users[1])
    return cold, warm, engine.stats["cached_tokens"] - before


def correctness_check(tiny: bool, device, mxfp4_experts: bool = False) -> None:
    """Before timing: (1) the KDA chunk kernel in use (fla's with H3GEN_FLA=1) against the torch reference, and
    (2) the engine (CUDA graphs and every fused kernel) against the model's own generate with every kernel on its
    torch reference (H3GEN_TRITON=0): greedy tokens in float32 on 4 layers of the benchmark's config, b=1 and
    b=3. Prints what it finds; a mismatch is reported, not raised, so the timings still come."""
    import dataclasses
    import os

    from h3gen.kernels.kda import kda_chunked, kda_gate, l2_normalize
    from h3gen.kernels.kda import reference as kda_reference

    gen = torch.Generator(device=device).manual_seed(0)
    b, t, h, k = 1, 300, 4, (16 if tiny else 128)
    q = l2_normalize(torch.randn(b, t, h, k, generator=gen, device=device))
    key = l2_normalize(torch.randn(b, t, h, k, generator=gen, device=device))
    v = torch.randn(b, t, h, k, generator=gen, device=device)
    g = kda_gate(
        torch.randn(b, t, h, k, generator=gen, device=device),
        torch.rand(h, device=device) * 2,
        torch.randn(h * k, generator=gen, device=device) * 0.5,
        -5.0,
    )
    beta = torch.rand(b, t, h, generator=gen, device=device)
    state = torch.randn(b, h, k, k, generator=gen, device=device) * 0.1
    expected = kda_reference.kda_chunked(q, key, v, g, beta, k**-0.5, state)
    got = kda_chunked(q, key, v, g, beta, k**-0.5, state)
    errors = [
        ((x.double() - y.double()).norm() / y.double().norm()).item() for x, y in zip(got, expected, strict=False)
    ]
    print(
        f"check: KDA chunk ({'fla' if os.environ.get('H3GEN_FLA') == '1' else 'torch'}) vs reference, relL2 "
        f"output {errors[0]:.1e}, state {errors[1]:.1e}",
        flush=True,
    )

    config = dataclasses.replace(
        mid_config(tiny),
        num_hidden_layers=4,
        attention_types=["kda", "kda", "kda", "mla"],
        ffn_types=["dense", "moe", "moe", "moe"],
    )
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=device), seed=0).float().eval()
    if mxfp4_experts:
        quantize_experts_mxfp4(model)
    asks = prompts(3, 100, config.vocab_size, seed=5)
    asks[1] = asks[1][:37]
    previous = os.environ.get("H3GEN_TRITON")
    os.environ["H3GEN_TRITON"] = "0"
    try:
        expected = [model.generate(torch.tensor([p], device=device), 20)[0].tolist() for p in asks]
    finally:
        if previous is None:
            del os.environ["H3GEN_TRITON"]
        else:
            os.environ["H3GEN_TRITON"] = previous
    for batch in (1, 3):
        engine = K3Engine(
            model,
            max_batch=batch,
            prefix_cache=False,
            page_size=16 if tiny else 64,
            chunk_size=64,
            max_context=512,
            cuda_graphs=True,
        )
        done = engine.generate(asks[:batch], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        same = [r.output_ids == e for r, e in zip(done, expected, strict=False)]
        print(
            f"check: float32 engine b={batch} ({'CUDA graphs' if device.type == 'cuda' else 'static path'}) "
            f"greedy tokens equal to the torch reference: {same}",
            flush=True,
        )
    # Sampled rows: with decode graphs they are drawn on the device (steps launched ahead); the same seeds without
    # graphs must give the same tokens.
    sampled = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=7 + i, ignore_eos=True)
        for i in range(3)
    ]
    outputs = {}
    for graphs in (False, True):
        engine = K3Engine(
            model,
            max_batch=3,
            prefix_cache=False,
            page_size=16 if tiny else 64,
            chunk_size=64,
            max_context=512,
            cuda_graphs=graphs,
        )
        outputs[graphs] = [r.output_ids for r in engine.generate(asks, sampled)]
    print(
        f"check: float32 engine b=3 sampled, decode graphs vs eager: same tokens "
        f"{[a == b for a, b in zip(outputs[True], outputs[False], strict=False)]}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed per batch size")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the kernels and the engine against the torch references first (float32, 4 layers)",
    )
    parser.add_argument(
        "--mxfp4-experts",
        action="store_true",
        help="routed experts in MXFP4, as K3 ships them (decode graphs asked for explicitly)",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        print("no CUDA device: running the tiny config (use --tiny to ask for it)", file=sys.stderr)
        args.tiny = True
    if args.check:
        correctness_check(args.tiny, device, args.mxfp4_experts)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices: more OpenMP threads only stall
    steps = args.steps or (8 if args.tiny else 32)
    system_len, prefill_len = (256, 512) if args.tiny else (4096, 8192)
    chunk = 64 if args.tiny else 2048
    torch.manual_seed(0)
    config = mid_config(args.tiny)
    with torch.device("meta"):  # allocated and filled where it runs
        model = K3ForCausalLM(config)
    model = randomize(model.to_empty(device=device), seed=0).to(dtype).eval()
    for name, param in model.named_parameters():  # the float32 islands K3 keeps (the loader's rule)
        if keeps_fp32(name, K3ForCausalLM.keep_fp32_modules):
            param.data = param.data.float()
    if args.mxfp4_experts:
        quantize_experts_mxfp4(model)
    bandwidth = measured_bandwidth(device)
    roof_bw = bandwidth if bandwidth == bandwidth else H200_BANDWIDTH
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {params / 1e9:.3f} B dense "
        f"params ({dtype}{', MXFP4 experts' if args.mxfp4_experts else ''}), {weight_bytes / 1e9:.2f} GB of "
        f"weights, measured copy bandwidth {bandwidth / 1e12:.2f} TB/s",
        flush=True,
    )

    engine_options = dict(page_size=64 if not args.tiny else 16, chunk_size=chunk, max_context=2048)
    ref_rate, ref_tokens = reference_rate(model, prompts(1, 128, config.vocab_size, seed=1)[0], steps, device)
    rows = []
    # The engine without CUDA graphs first (on a GPU every engine prepares the model: experts stacked, projections
    # fused), then with them.
    variants = [(1, False, False)] if device.type == "cuda" else []
    variants += [(batch, True if args.mxfp4_experts else None, False) for batch in (1, 8, 32)]
    variants += [(batch, True if args.mxfp4_experts else None, True) for batch in (1, 8)]  # sampled as a planner
    for batch, graphs, sampled in variants:
        rate, outputs = decode_rate(
            model, batch, 128, steps, device, sampled=sampled, cuda_graphs=graphs, **engine_options
        )
        roof = batch * roof_bw / decode_bytes(model, batch)
        label = "eager" if graphs is False else ("CUDA graphs" if device.type == "cuda" else "eager")
        label += ", sampled" if sampled else ""
        row = dict(
            phase=f"decode b={batch} ({label})",
            tokens_per_s=f"{rate:.1f}",
            ms_per_step=f"{batch / rate * 1e3:.3f}",
            roofline=f"{roof:.0f}",
            of_roofline=f"{rate / roof:.1%}",
        )
        if batch == 1 and not sampled:
            same = outputs[0][: len(ref_tokens)] == ref_tokens[: len(outputs[0])]
            row.update(reference=f"{ref_rate:.1f}", ratio=f"{rate / ref_rate:.2f}", same_tokens=same)
        rows.append(row)
    prefill = prefill_rate(model, prefill_len, device, chunk)
    rows.append(dict(phase=f"prefill {prefill_len}", tokens_per_s=f"{prefill:.0f}"))
    cold, warm, cached = time_to_first_token(model, system_len, 64, device, chunk)
    rows.append(dict(phase=f"TTFT {system_len}+64 cold", tokens_per_s=f"{cold * 1e3:.1f} ms"))
    rows.append(
        dict(
            phase=f"TTFT {system_len}+64 cached",
            tokens_per_s=f"{warm * 1e3:.1f} ms",
            ratio=f"{cold / warm:.2f}",
            reference=f"{cached} cached",
        )
    )
    print_table(
        rows, ["phase", "tokens_per_s", "ms_per_step", "roofline", "of_roofline", "reference", "ratio", "same_tokens"]
    )


if __name__ == "__main__":
    main()
