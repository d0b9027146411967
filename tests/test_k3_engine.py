"""The K3 engine: continuous batching equals one-at-a-time generation, the radix prefix cache gives what no cache
gives (MLA-only, KDA-only and hybrid models, forks inside chunks and pages), a too-small pool finishes every
request through waiting and preemption, shared prefixes never leak KDA state, the sampler's parameters."""

import dataclasses

import pytest
import torch
from helpers.k3_reference import filter_logits

from h3gen.errors import RequestError
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.demo_model import randomize, tiny_config
from h3gen.pipelines.k3.engine import K3Engine, MemoryPool, RadixCache, SamplingParams
from h3gen.pipelines.k3.model import K3ForCausalLM, quantize_experts_mxfp4

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These models are tiny: a second OpenMP thread only adds stalls on a shared, busy CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small_config(types: list[str]) -> K3Config:
    return K3Config(
        model_type="kimi_linear",
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=len(types),
        rms_norm_eps=1e-5,
        attention_types=types,
        ffn_types=["dense"] + ["moe"] * (len(types) - 1),
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        linear_num_heads=2,
        linear_head_dim=8,
        conv_kernel_size=3,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_scaling_factor=2.0,
        eos_token_id=1,
    )


FAMILIES = {
    "mla": lambda: _small_config(["mla", "mla", "mla"]),
    "kda": lambda: _small_config(["kda", "kda", "kda"]),
    # The tiny K3: KDA + gated MLA, LatentMoE with SiTU, block Attention Residuals.
    "hybrid": lambda: dataclasses.replace(K3Config.from_dict(tiny_config()), experts_mxfp4=False),
    # The same with its routed experts in MXFP4, as K3 ships them (see `_model`).
    "hybrid-mxfp4": lambda: dataclasses.replace(K3Config.from_dict(tiny_config()), experts_mxfp4=False),
}
_MODELS = {}


def _model(family: str) -> K3ForCausalLM:
    if family not in _MODELS:
        model = randomize(K3ForCausalLM(FAMILIES[family]()), seed=3).eval()
        _MODELS[family] = quantize_experts_mxfp4(model) if family.endswith("mxfp4") else model
    return _MODELS[family]


def _prompts(model, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, prompt, max_tokens):
    """One request alone through the model's own cache (no engine): greedy tokens."""
    return model.generate(torch.tensor([prompt]), max_tokens)[0].tolist()


def _engine(model, **kwargs):
    options = dict(page_size=4, chunk_size=8, max_batch=8, max_context=160)
    options.update(kwargs)
    return K3Engine(model, **options)


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static-decode"])
@pytest.mark.parametrize("family", ["mla", "kda", "hybrid", "hybrid-mxfp4"])
def test_batched_greedy_generation_equals_one_at_a_time_fp32(family, static_decode, monkeypatch):
    """`static_decode`: the decode steps run through the CUDA-graph path (static buffers, stacked experts, padded
    batches), eagerly on the CPU, with each MLA sequence's rows split into runs as on a GPU."""
    if static_decode:
        monkeypatch.setattr("h3gen.pipelines.k3.attention.mla_decode_splits", lambda batch, device: 4)
    model = _model(family)
    prompts = _prompts(model, [5, 23, 1, 40, 17, 9])
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (12, 7, 12, 10, 3, 12)]
    expected = [_reference(model, p, sp.max_tokens) for p, sp in zip(prompts, params, strict=True)]
    engine = _engine(model, prefix_cache=False, cuda_graphs=static_decode)
    if static_decode:
        graphs = engine.graphs
        calls, kept = [], []
        original = graphs.launch
        graphs.launch = lambda *args: calls.append(len(args[1])) or original(*args)
        from h3gen.pipelines.k3.engine.graphs import DecodeBuffers

        stage = DecodeBuffers.stage
        monkeypatch.setattr(
            DecodeBuffers,
            "stage",
            lambda self, *a, keep_tokens=False: kept.append(keep_tokens) or stage(self, *a, keep_tokens=keep_tokens),
        )
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3], strict=True)]
    engine.step()
    engine.step()  # the rest join a batch that is already decoding
    requests += [engine.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:], strict=True)]
    while engine.waiting or engine.running:
        engine.step()
    assert [r.output_ids for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)
    assert engine.stats["decode_tokens"] < sum(sp.max_tokens for sp in params)  # decodes were batched
    scratch = int(static_decode)  # the decode graphs keep one page and one slot for padding rows
    usage = engine.pool.usage()
    assert usage["pages_used"] == scratch * engine.pool.uses_pages
    assert usage["slots_used"] == scratch * engine.pool.uses_slots
    if static_decode:  # every decode step took the static path, at batch sizes that needed padding too
        assert sum(calls) == engine.stats["decode_tokens"] and {3, 5, 6} & set(calls)
        # steps launched ahead read the previous step's argmax where it was written, with no copy of their ids
        assert True in kept and False in kept
        moes = [m for m in model.modules() if hasattr(m, "stack_experts")]
        stacked = [m.stacked_mxfp4 if family.endswith("mxfp4") else m.stacked for m in moes]
        assert moes and all(s is not None for s in stacked)  # the experts were picked on the device
    from h3gen.pipelines.k3.engine.graphs import capture_blocker

    assert capture_blocker(16, True) is None and "power-of-two" in capture_blocker(24, True)
    assert capture_blocker(4, False) is None  # without MLA layers there are no pages to address


@pytest.mark.parametrize("family", ["mla", "kda", "hybrid"])
def test_prefix_cache_hit_gives_the_no_cache_output(family):
    model = _model(family)
    base = _prompts(model, [45], seed=1)[0]
    tails = _prompts(model, [6, 9, 3, 11], seed=2)
    # Forks at 13 and 19 (inside an 8-token chunk and a 4-token page), a full repeat, an extension past the end.
    prompts = [
        base,
        base[:13] + tails[0],
        base[:19] + tails[1],
        base,
        base[:13] + tails[0] + tails[2],
        base + tails[3],
        base[:13] + tails[1],
    ]
    plain = _engine(model, prefix_cache=False)
    expected = [plain.generate([p], SamplingParams(max_tokens=6, **GREEDY))[0].output_ids for p in prompts]
    engine = _engine(model)
    got = []
    for prompt in prompts:  # one after another, so each finds what the earlier ones left
        got.append(engine.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].output_ids)
    assert got == expected
    assert engine.stats["cached_tokens"] >= 13 * 2 + 40  # the hits were real
    assert engine.stats["prefill_tokens"] < plain.stats["prefill_tokens"]
    # Everything still held belongs to the cache; clearing it frees the pool.
    engine.cache.clear()
    assert engine.pool.usage()["pages_used"] == 0 and engine.pool.usage()["slots_used"] == 0


@pytest.mark.parametrize("family", ["mla", "hybrid"])
def test_decode_steps_launched_ahead_drop_the_token_after_a_stop(family):
    """With decode graphs (run eagerly here) the engine launches each greedy step before reading the previous
    one's tokens. A request that stops on a stop token then had one token too many computed: that token is dropped,
    its memory is not donated to the prefix cache, and later requests that hit the cache get the no-cache answer."""
    model = _model(family)
    prompts = _prompts(model, [9, 17, 5, 26], seed=7)
    free = [_reference(model, p, 12) for p in prompts]
    stops = [[out[5]] for out in free]  # each stops within its first six tokens
    params = [SamplingParams(max_tokens=12, stop_token_ids=stop, **GREEDY) for stop in stops]
    plain = _engine(model, prefix_cache=False)
    expected = [plain.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    assert all(len(e) < 6 for e in expected)
    engine = _engine(model, cuda_graphs=True)
    launches = []
    original = engine.graphs.launch
    engine.graphs.launch = lambda *args: (
        launches.append((isinstance(args[0], torch.Tensor), len(args[1]))) or original(*args)
    )
    for _ in range(2):  # the second round hits what the first left in the cache
        got = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
        assert [r.output_ids for r in got] == expected and all(r.finish_reason == "stop" for r in got)
    together = engine.generate(prompts, params)  # and as one batch
    assert [r.output_ids for r in together] == expected
    # Prompts that run through the stopped requests' rows and on: they resume from what the cache holds there.
    extended = [p + e + t for p, e, t in zip(prompts, expected, _prompts(model, [3, 2, 4, 3], seed=8), strict=True)]
    more = [SamplingParams(max_tokens=5, **GREEDY)] * len(prompts)
    assert [r.output_ids for r in engine.generate(extended, more)] == [
        r.output_ids for r in plain.generate(extended, more)
    ]
    assert sum(ahead for ahead, _ in launches) > 0 and engine.stats["cached_tokens"] > 0
    assert sum(rows for _, rows in launches) > engine.stats["decode_tokens"]  # some rows' tokens were dropped


def test_sampled_requests_draw_the_same_tokens_with_steps_launched_ahead():
    """Decode graphs (run eagerly here) launch each step before the host reads the previous one's tokens; rows that
    sample draw on the device with the request's own generator. Every request, greedy or sampled, batched or
    preempted and resumed, then gets what it gets alone without graphs."""
    model = _model("hybrid")
    prompts = _prompts(model, [11, 6, 19, 14, 9, 16], seed=9)
    params = [
        SamplingParams(max_tokens=16, temperature=t, top_k=k, top_p=p, seed=seed, ignore_eos=True)
        for t, k, p, seed in (
            (0.8, 0, 1.0, 11),
            (1.3, 20, 0.9, 12),
            (0.0, 0, 1.0, None),
            (1.0, 5, 1.0, 13),
            (0.7, 0, 0.8, 14),
            (1.1, 30, 0.95, 15),
        )
    ]
    alone = [
        _engine(model, prefix_cache=False).generate([p], sp)[0].output_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    engine = _engine(model, prefix_cache=False, cuda_graphs=True)
    launches = []
    original = engine.graphs.launch
    engine.graphs.launch = lambda *args: launches.append(isinstance(args[0], torch.Tensor)) or original(*args)
    assert [r.output_ids for r in engine.generate(prompts, params)] == alone
    assert sum(launches) > 0  # steps were launched ahead with sampled rows in the batch
    # A pool for about two of them: the rest wait, running ones are preempted and resume with their sampler state.
    probe = MemoryPool(model.config, torch.float32, "cpu", 0, page_size=4)
    small = _engine(
        model, prefix_cache=False, cuda_graphs=True, pool_bytes=int(2.5 * (10 * probe.page_bytes + probe.slot_bytes))
    )
    assert [r.output_ids for r in small.generate(prompts, params)] == alone
    assert small.stats["preemptions"] > 0
    # Preempted while a step for it is in flight: that step's draw is dropped without touching its generator.
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine._in_flight is None or len(requests[1].output_ids) < 4:
        engine.step()
    engine._preempt(requests[1])
    while engine.waiting or engine.running:
        engine.step()
    assert [r.output_ids for r in requests] == alone and requests[1].preemptions == 1


@pytest.mark.parametrize("family", ["kda", "hybrid"])
def test_requests_sharing_a_prefix_do_not_contaminate_each_others_kda_state(family):
    model = _model(family)
    base = _prompts(model, [30], seed=4)[0]
    tails = _prompts(model, [5, 7, 2, 9, 4], seed=5)
    prompts = [base[:cut] + tail for cut, tail in zip((30, 11, 21, 30, 5), tails, strict=True)] + [base]
    isolated = [
        _engine(model, prefix_cache=False).generate([p], SamplingParams(max_tokens=8, **GREEDY))[0].output_ids
        for p in prompts
    ]
    engine = _engine(model)
    engine.generate([base], SamplingParams(max_tokens=4, **GREEDY))  # seed the cache with the shared prefix
    for _ in range(2):  # all at once, then again against the checkpoints the first round left
        got = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))]
        assert got == isolated
    assert engine.stats["cached_tokens"] > 0


@pytest.mark.slow  # 3.5 s per case
@pytest.mark.parametrize("prefix_cache,static_decode", [(False, False), (True, False), (True, True)])
def test_pool_exhaustion_finishes_every_request_through_waiting_and_preemption(prefix_cache, static_decode):
    model = _model("hybrid")
    prompts = _prompts(model, [37, 30, 41, 26, 33, 39, 29, 35], seed=6)
    expected = [_reference(model, p, 24) for p in prompts]
    probe = MemoryPool(model.config, torch.float32, "cpu", 0, page_size=4)
    # Room for about 2.5 requests of 65 tokens (17 pages and a state slot each): the rest wait, and the running
    # ones outgrow the pool while decoding, so some are preempted and resumed.
    pool_bytes = int(2.5 * (17 * probe.page_bytes + probe.slot_bytes))
    engine = _engine(model, pool_bytes=pool_bytes, prefix_cache=prefix_cache, cuda_graphs=static_decode)
    requests = [engine.add_request(p, SamplingParams(max_tokens=24, **GREEDY)) for p in prompts]
    most = 0
    while engine.waiting or engine.running:
        engine.step()
        most = max(most, len(engine.running))
    assert [r.output_ids for r in requests] == expected
    assert all(r.error is None for r in requests)
    assert engine.stats["preemptions"] > 0 and most >= 2
    small = _engine(model, pool_bytes=probe.slot_bytes + 5 * probe.page_bytes)  # 20 tokens at most
    small.generate([prompts[0][:12]], SamplingParams(max_tokens=8, **GREEDY))
    with pytest.raises(RequestError, match="does not fit"):
        small.add_request(prompts[0][:12], SamplingParams(max_tokens=9))


def test_pool_pages_grow_up_and_slots_down_in_one_buffer():
    config = _small_config(["mla", "kda"])
    pool = MemoryPool(config, torch.float32, "cpu", 10_000, page_size=4)
    pages = [pool.alloc_page() for _ in range(3)]
    slots = [pool.alloc_slot() for _ in range(2)]
    assert pages == [0, 1, 2] and slots == [0, 1]
    # Fill the rest with pages; the two ends meet and neither may cross.
    while pool.alloc_page() is not None:
        pass
    assert pool.alloc_slot() is None
    high = pool._pages.high
    assert high * pool.page_bytes <= pool.capacity - 2 * pool.slot_bytes
    # Freeing the top pages lets a slot take their bytes: capacity follows traffic.
    needed = -(-pool.slot_bytes // pool.page_bytes)
    for page in range(high - 1, high - 1 - needed - 1, -1):
        pool.decref(page)
    assert pool.alloc_slot() == 2
    # Data written to a slot and a page never overlap.
    pool.slots[pool.slot_row(2)] = 7.0
    assert not (pool.pages[: pool._pages.high] == 7.0).any()


def test_radix_cache_splits_shares_pages_and_evicts_least_recently_used():
    config = _small_config(["mla", "kda"])
    pool = MemoryPool(config, torch.float32, "cpu", 200_000, page_size=4)
    cache = RadixCache(pool)
    a_pages = [pool.alloc_page() for _ in range(3)]  # tokens 0..9
    slot = pool.alloc_slot()
    cache.insert(list(range(10)), a_pages, {8: slot})
    b_pages = a_pages[:1] + [pool.alloc_page(), pool.alloc_page()]  # forks at 6, inside page 1 (copied)
    cache.insert(list(range(6)) + [50, 51, 52, 53], b_pages, {})
    hit = cache.match(list(range(10)) + [99], limit=10)
    assert (hit.matched, hit.resume, hit.slot) == (10, 8, slot)
    assert hit.pages == a_pages[:2]
    hit = cache.match(list(range(6)) + [50, 51, 52, 7], limit=10)
    assert hit.matched == 9 and hit.resume == 0  # no checkpoint on this path: KDA must replay from 0
    assert cache.size()["nodes"] == 3
    for page in a_pages + b_pages[1:]:
        pool.decref(page)  # the requests are gone; the tree keeps what it references
    assert pool.usage()["pages_used"] == 5
    cache.match(list(range(10)), limit=9)  # touch the first branch: the second is now least recent
    assert cache.evict_one()
    assert cache.match(list(range(6)) + [50], limit=7).matched == 6
    cache.clear()
    assert pool.usage() | {} == pool.usage() and pool.usage()["pages_used"] == 0
    assert pool.usage()["slots_used"] == 0


def test_sampler_seed_top_k_top_p_and_max_tokens():
    model = _model("mla")
    prompt = _prompts(model, [9], seed=7)[0]
    engine = _engine(model)

    def run(**kwargs):
        return engine.generate([prompt], SamplingParams(**kwargs))[0].output_ids

    assert run(max_tokens=8, seed=5, ignore_eos=True) == run(max_tokens=8, seed=5, ignore_eos=True)
    assert run(max_tokens=8, seed=5, ignore_eos=True) != run(max_tokens=8, seed=6, ignore_eos=True)
    greedy = run(max_tokens=8, **GREEDY)
    assert run(max_tokens=8, top_k=1, seed=1, ignore_eos=True) == greedy
    assert run(max_tokens=8, top_p=1e-6, temperature=2.0, seed=2, ignore_eos=True) == greedy
    assert len(run(max_tokens=3, **GREEDY)) == 3
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.8))
    probs = torch.softmax(logits, 0)
    assert kept.tolist() == [True, True, False, False, False] and probs[:1].sum() < 0.8 <= probs[:2].sum()
    assert torch.isfinite(filter_logits(logits, 1.0, 3, 1.0)).tolist() == [True, True, True, False, False]
    for bad, field in (
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
    ):
        with pytest.raises(RequestError) as info:
            engine.add_request(prompt, SamplingParams(**bad))
        assert info.value.field == field
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary|must be in"):
        engine.add_request([10_000], SamplingParams())
    with pytest.raises(RequestError, match="vision tower"):
        engine.add_request(prompt, SamplingParams(max_tokens=4), images=["picture"])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.5, 3, 1.0), (1.0, 4, 0.9)])
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p):
    """`draw` gives only tokens `filter_logits` keeps, at their renormalised probabilities (3,000 draws)."""
    from h3gen.pipelines.k3.engine.sampling import draw

    logits = torch.tensor([2.0, 1.5, 1.5, 0.5, 0.0, -1.0, float("-inf"), 0.8])
    expected = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    generator = params.generator("cpu")
    counts = torch.bincount(torch.cat([draw(logits, params, generator) for _ in range(3000)]), minlength=8)
    assert counts[expected == 0].sum() == 0
    assert (counts / 3000 - expected).abs().max() < 0.03


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (0.6, 0, 0.95), (1.2, 5, 0.9)])
def test_a_batch_sampling_alike_draws_what_its_rows_draw_alone(temperature, top_k, top_p):
    """Rows that share their sampling parameters are drawn together (one sort, one kernel): each gets the token it
    gets alone from the same generator state, tied logits included."""
    from h3gen.pipelines.k3.engine.sampling import draw, sample_on_device

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()  # ties
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s) for s in range(4)]
    for _ in range(5):
        together = sample_on_device(logits, params, [p.generator("cpu") for p in params], logits.argmax(-1))
        alone = torch.cat([draw(row, p, p.generator("cpu")) for row, p in zip(logits, params, strict=True)])
        assert torch.equal(together, alone)
        logits = logits.roll(7, dims=1)


class _CharTokenizer:
    """One token per character (ids 2..96), id 1 is end of sequence."""

    eos_token_id = 1

    def decode(self, ids, skip_special=False):
        return "".join(chr(30 + i) for i in ids if i >= 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: host waits are a CUDA stream's")
def test_device_sampling_never_waits_for_the_gpu():
    """Tokens drawn for a step launched ahead must not make the host wait for the GPU (the next step is queued
    behind them): no synchronising call in `sample_on_device`, with top-k and top-p both on."""
    from h3gen.pipelines.k3.engine.sampling import sample_on_device

    logits = torch.randn(3, 1000, device="cuda")
    params = [
        SamplingParams(temperature=0.6, top_p=0.95),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40),
    ]
    generators = [p.generator("cuda") for p in params]
    argmax = logits.argmax(dim=-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_on_device(logits, params, generators, argmax)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (3,) and tokens[1] == argmax[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (engines on a CPU leave the model as it is)")
def test_engine_without_graphs_decodes_with_stacked_experts():
    """Turning CUDA graphs off must not leave decode on the per-expert host-routed path."""
    from h3gen.pipelines.k3.model import K3MoE

    model = randomize(K3ForCausalLM(FAMILIES["kda"]()), seed=0).cuda().eval()
    engine = K3Engine(model, page_size=16, chunk_size=16, max_batch=2, prefix_cache=False, cuda_graphs=False)
    assert engine.graphs is None
    assert all(m.stacked is not None for m in model.modules() if isinstance(m, K3MoE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA-graph capture")
@pytest.mark.parametrize("max_batch", [1, 5])
def test_decode_graph_capture_allocates_no_arrival_counters(monkeypatch, max_batch):
    """Every arrival-counter buffer the captured decode step uses exists before the capture (the warm-up runs every
    op the graph holds): one allocated during it would put its zero-fill into every replay. The argmax's keys
    (lm_head's kernel leaves them, up to four sequences) or, past four, the Triton argmax's counters (a vocabulary
    wide enough for it) are used only by the graph's last ops."""
    from h3gen.kernels import _arrivals
    from h3gen.kernels.argmax import MIN_WIDTH

    allocations = []

    class Recording(dict):
        def __setitem__(self, key, value):
            allocations.append((key[1], torch.cuda.is_current_stream_capturing()))
            super().__setitem__(key, value)

    monkeypatch.setattr(_arrivals, "_BUFFERS", Recording())
    config = dataclasses.replace(_small_config(["kda", "mla", "kda"]), vocab_size=MIN_WIDTH + 37)
    model = randomize(K3ForCausalLM(config), seed=0).cuda().eval()
    engine = K3Engine(model, page_size=16, chunk_size=16, max_batch=max_batch, prefix_cache=False, cuda_graphs=True)
    engine.generate(_prompts(model, [9] * max_batch, seed=2), SamplingParams(max_tokens=4, **GREEDY))
    family = "argmax_keys" if max_batch <= 4 else "argmax"
    assert (family, False) in allocations and not [a for a in allocations if a[1]]


def test_stop_strings_and_streaming_deltas_add_up_to_the_text():
    model = _model("kda")
    prompt = _prompts(model, [7], seed=8)[0]
    engine = _engine(model, tokenizer=_CharTokenizer())
    full = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert len(full.text) == 12
    stop = full.text[5:7]
    first = full.text.find(stop)
    outputs = list(engine.stream(prompt, SamplingParams(max_tokens=12, stop=[stop], **GREEDY)))
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert outputs[-1].text == full.text[:first]
    assert "".join(o.delta for o in outputs) == full.text[:first]
    assert all(stop not in o.delta for o in outputs)


def test_streamed_text_grows_by_each_tokens_bytes(tmp_path):
    """The engine appends each token's bytes instead of detokenizing the whole output every step: the text after
    every step equals a full decode of the tokens so far, also when a character's UTF-8 bytes span tokens. The
    deltas add up to the text although the first step yields two tokens (the prefill's and a decode's)."""
    from h3gen.pipelines.k3.demo_model import write_tokenizer
    from h3gen.pipelines.k3.tokenizer import K3Tokenizer

    write_tokenizer(tmp_path)
    tokenizer = K3Tokenizer.from_folder(tmp_path)
    model = _model("kda")
    engine = _engine(model, tokenizer=tokenizer)
    prompt = _prompts(model, [6], seed=11)[0]
    seen = []
    for out in engine.stream(prompt, SamplingParams(max_tokens=24, **GREEDY)):
        seen.append(out)
        assert out.text == tokenizer.decode(out.token_ids, skip_special=True)
    assert "".join(o.delta for o in seen) == seen[-1].text
    split = "\u00e9".encode()  # two bytes as two single-byte tokens: replaced until both are there
    assert tokenizer.decode([split[0]]) == "\ufffd" and tokenizer.decode(list(split)) == "\u00e9"


def test_mxfp4_experts_widened_for_a_long_prefill_match_the_per_expert_path(monkeypatch):
    """Stacked MXFP4 experts and more (token, slot) pairs than the per-pair path takes: the experts are widened to
    the compute dtype once for the call and run through the grouped path; equal to the unstacked per-expert loop."""
    import h3gen.pipelines.k3.model as k3_model
    import h3gen.pipelines.k3.moe as k3_moe

    model = quantize_experts_mxfp4(randomize(K3ForCausalLM(FAMILIES["hybrid-mxfp4"]()), seed=7).eval())
    moe = next(m for m in model.modules() if isinstance(m, k3_model.K3MoE))
    x = torch.randn(150, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = moe(x)  # per-expert loop over MXFP4 linears
        assert moe.stack_experts() and moe.stacked_mxfp4 is not None
        monkeypatch.setattr(k3_moe, "MXFP4_DEVICE_ROUTING_MAX_PAIRS", 0)  # force the widened path
        calls = []
        original = k3_moe.widened_mxfp4
        monkeypatch.setattr(k3_moe, "widened_mxfp4", lambda *args: calls.append(args[-1]) or original(*args))
        got = moe(x)
    assert calls and ((got - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("family", ["mla", "kda", "hybrid", "hybrid-mxfp4", "hybrid-mxfp4-silu"])
def test_decode_preparation_keeps_the_model_function(family, monkeypatch):
    """Stacking experts (with the shared expert among them where it fits, else its SwiGLU and down fused with the
    add of the routed output) and fusing projections (what the decode graphs do to a model) leaves the state dict
    and the logits of a long prefill (grouped stacked-expert path) and of decode steps (per-pair expert path, fused
    projections) as they were."""
    import h3gen.pipelines.k3.model as k3_model
    from h3gen.pipelines.k3.engine.graphs import prepare_for_decode

    config = FAMILIES[family.removesuffix("-silu")]()
    if family.endswith("-silu"):  # SwiGLU experts: the shared expert's fused decode tail applies
        config = dataclasses.replace(config, hidden_act="silu")
    model = randomize(K3ForCausalLM(config), seed=4).eval()
    if "mxfp4" in family:
        model = quantize_experts_mxfp4(model)
    added = []
    original_tail = k3_model.expert_swiglu_down
    monkeypatch.setattr(
        k3_model,
        "expert_swiglu_down",
        lambda *args, add=None: added.append(add is not None) or original_tail(*args, add=add),
    )
    prompt = torch.tensor(_prompts(model, [150], seed=9))  # 150 tokens x top-2 = 300 pairs: the grouped path

    def run():
        cache = model.new_cache(page_size=4)
        logits = [model(prompt, cache)[:, -1]]
        for token in (5, 17, 3):
            logits.append(model(torch.tensor([[token]]), cache)[:, -1])
        return torch.stack(logits)

    with torch.no_grad():
        before = run()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        prepare_for_decode(model)
        moes = [m for m in model.modules() if hasattr(m, "stack_experts")]
        mxfp4 = "mxfp4" in family
        assert moes and all((m.stacked if mxfp4 else m.stacked_mxfp4) is None for m in moes)
        assert all((m.stacked_mxfp4 if mxfp4 else m.stacked) is not None for m in moes)
        # the shared expert rides in the stack where it has the routed experts' shapes (not under LatentMoE, not
        # with MXFP4 experts); else its decode tail takes the one-slot routing
        assert all(m.shared_in_stack == (not family.startswith("hybrid")) for m in moes)
        assert all((m.one_slot is not None) == family.startswith("hybrid") for m in moes)
        kdas = [m for m in model.modules() if hasattr(m, "fused_up_gates")]
        assert all((m.fused_up_gates is not None) == (not m.config.use_full_rank_gate) for m in kdas)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        after = run()
    assert any(added) == family.endswith("-silu")
    # Equal up to float32 rounding (a fused GEMM may sum in another order).
    assert ((after - before).norm() / before.norm()).item() < 1e-5
