"""LoRA: every file format against diffusers' own loader (float32, CPU), stacked adapters, ref2va routing, the
FP8 / MXFP4 bases, merging, bad files, and per-request switching in the pipeline."""

import copy

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from helpers.h3_tiny import TINY_CONFIGS, max_rel_err, random_inputs, randomize_
from helpers.lora_files import (
    TURBO_MODULES,
    diffusers_holder,
    diffusers_shapes,
    native_shapes,
    random_factors,
    write_diffusers,
    write_native,
)

from h3gen.device_memory import available_device_memory
from h3gen.errors import RequestError
from h3gen.kernels.fp8_quant import quantize_rows
from h3gen.lora import LoraFactors, LoraGroup, wide_input
from h3gen.pipelines.h3.adapter_memory import DeviceMemory
from h3gen.pipelines.h3.lora_formats import read_lora
from h3gen.pipelines.h3.lora_registry import (
    LORA_GPU_RESERVE,
    LoraRegistry,
    activate,
    check_targets,
    deactivate,
    fp8_layers,
    lora_budget_bytes,
    lora_device_bytes,
    merge_into,
)
from h3gen.pipelines.h3.tiers import set_quality
from h3gen.pipelines.h3.transformer import H3Transformer
from h3gen.pipelines.h3.transformer_config import H3TransformerConfig
from h3gen.quant.fp8 import Fp8Linear
from h3gen.quant.mxfp4 import MXFP4Linear

TOLERANCE = 1e-4
CONFIG = TINY_CONFIGS[0]
# One 128-wide head: diffusers de-interleaves a DiffSynth QKV by a hard-coded head size of 128.
HEAD128 = dict(
    num_attention_heads=1,
    attention_head_dim=128,
    hidden_size=48,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=80,
    text_dim=40,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=24,
    rope_freq_dim=4,
)
INPUTS = dict(num_text=7, latent_frames=3, latent_hw=(4, 6), audio_latents=5, anchors=("first",), distinct_timesteps=3)


def _pair(config, seed=0):
    reference = MiniMaxH3Transformer3DModel(**config).eval()
    randomize_(reference, seed)
    ours = H3Transformer.from_config(config).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _run(model, inputs, tier="exact"):
    extra = {}
    if tier != "exact":
        extra = dict(adaln_tables=model.precompute_adaln([inputs["timestep"]]), step=0)
    with torch.no_grad():
        video, audio = model(**inputs, return_dict=False, **extra)
    return torch.cat([video.flatten(), audio.flatten()])


def _registry(model):
    return LoraRegistry(8, head_dim=model.config.attention_head_dim, check=lambda lora: check_targets(model, lora))


def _ours(model, files, task="t2va", inputs=None, tier="exact", **register):
    """Our output with `files` (`[(path, scale)]`) active, and our registry."""
    registry = _registry(model)
    adapters = [(registry.adapter(registry.register(path, **register)), scale) for path, scale in files]
    set_quality(model, tier)
    activate(model, adapters, task, "cpu")
    out = _run(model, inputs, tier)
    deactivate(model)
    return out, registry


def _reference(reference, files, *, ref=False):
    """diffusers' output with `files` loaded through its H3 LoRA loader and weighted by `set_adapters`."""
    holder = diffusers_holder(transformer_ref=reference) if ref else diffusers_holder(transformer=reference)
    names = []
    for index, (path, _) in enumerate(files):
        holder.load_lora_weights(str(path), adapter_name=f"a{index}")
        names.append(f"a{index}")
    reference.set_adapters(names, [scale for _, scale in files])
    return reference


def _native_file(tmp_path, config, style, *, seed=1, rank=4, **kwargs):
    cfg = H3TransformerConfig(**config)
    factors = random_factors(native_shapes(cfg), rank, seed, ranks={"blocks.0.adaln_proj.linear": 2})
    path = tmp_path / f"{style}.safetensors"
    write_native(path, factors, style=style, **kwargs)
    return path


FORMATS = {
    # format name -> (config, file writer)
    "diffusers": (CONFIG, lambda tmp, m: _diffusers_file(tmp, m, "diffusers")),
    "peft": (CONFIG, lambda tmp, m: _diffusers_file(tmp, m, "peft")),
    "native": (
        CONFIG,
        lambda tmp, m: _native_file(tmp, CONFIG, "native", prefix="diffusion_model.", metadata={"alpha": "2"}),
    ),
    "kohya": (
        CONFIG,
        lambda tmp, m: _native_file(
            tmp, CONFIG, "kohya", alphas={"blocks.0.attn.qkv_proj": 2.0, "blocks.1.mlp.fc1": 8.0, "condition_proj": 1.0}
        ),
    ),
    "musubi": (CONFIG, lambda tmp, m: _native_file(tmp, CONFIG, "musubi", alphas={"blocks.1.attn.qkv_proj": 3.0})),
    "diffsynth": (HEAD128, lambda tmp, m: _native_file(tmp, HEAD128, "diffsynth", head_dim=128)),
}


def _diffusers_file(tmp_path, model, fmt):
    shapes = diffusers_shapes(model)
    if fmt == "peft":  # LightX2V Turbo's shape: attention and FFN of every block
        shapes = {k: v for k, v in shapes.items() if k.endswith(TURBO_MODULES)}
    factors = random_factors(shapes, 4, seed=7, ranks={"transformer_blocks.0.adaln_proj.linear": 2})
    path = tmp_path / f"{fmt}.safetensors"
    write_diffusers(path, factors, peft=fmt == "peft")
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_matches_diffusers(fmt, tmp_path):
    config, write = FORMATS[fmt]
    reference, ours = _pair(config)
    path = write(tmp_path, ours)
    assert read_lora(path, head_dim=ours.config.attention_head_dim).format == fmt
    inputs = random_inputs(config, seed=3, **INPUTS)
    base = _run(reference, inputs)
    expected = _run(_reference(reference, [(path, 1.0)]), inputs)
    assert max_rel_err(expected, base) > 0.05  # the adapter changes the output
    for tier in ("exact", "lossless"):
        got, _ = _ours(ours, [(path, 1.0)], inputs=inputs, tier=tier)
        assert max_rel_err(got, expected) <= TOLERANCE, tier
    assert max_rel_err(_run(ours, inputs), base) <= 1e-5  # deactivated: the plain model again


def test_read_lora_describes_a_file_without_loading_it(tmp_path):
    _, ours = _pair(CONFIG)
    path = _native_file(tmp_path, CONFIG, "kohya", alphas={"blocks.0.attn.qkv_proj": 2.0}, metadata={"tasks": "t2va"})
    lora = read_lora(path, head_dim=32)
    assert (lora.name, lora.format, lora.ranks, lora.alpha, lora.alpha_source) == (
        "kohya",
        "kohya",
        [2, 4],
        None,
        "module",
    )
    assert lora.partitions == ("transformer",) and lora.metadata == {"tasks": "t2va"}
    assert lora.qkv_layout == "grouped"
    assert {
        "transformer_blocks.0.attn.to_q",
        "token_refiner.refiner_blocks.1.ff.net.0.proj",
        "proj_in",
        "norm_out.linear",
        "time_embedder.linear_2",
    } <= set(lora.modules)
    assert len(lora.modules) == len(diffusers_shapes(ours))  # every linear of the model has its update


def test_turbo_v01_files_default_to_alpha_8_and_alpha_overrides(tmp_path):
    reference, ours = _pair(CONFIG)
    factors = random_factors({k: v for k, v in diffusers_shapes(ours).items() if k.endswith(TURBO_MODULES)}, 16, 2)
    turbo = tmp_path / "minimax_h3_fl2v_turbo_4step_v0.1_bf16.safetensors"
    write_diffusers(turbo, factors, peft=True)
    assert (read_lora(turbo).alpha, read_lora(turbo).alpha_source) == (8.0, "turbo-v0.1")
    inputs = random_inputs(CONFIG, seed=4, **INPUTS)
    for alpha, register in ((8, {}), (2, {"alpha": 2.0})):
        with_metadata = tmp_path / f"alpha{alpha}.safetensors"
        write_diffusers(with_metadata, factors, peft=True, metadata={"alpha": str(alpha)})
        expected = _run(_reference(copy.deepcopy(reference), [(with_metadata, 1.0)]), inputs)
        got, _ = _ours(ours, [(turbo, 1.0)], inputs=inputs, **register)
        assert max_rel_err(got, expected) <= TOLERANCE, alpha


def test_two_stacked_adapters_with_their_scales_match_diffusers(tmp_path, monkeypatch):
    reference, ours = _pair(CONFIG)
    first = _diffusers_file(tmp_path, ours, "diffusers")
    second = _native_file(tmp_path, CONFIG, "kohya", seed=5, alphas={"blocks.1.attn.qkv_proj": 2.0})
    files = [(first, 0.7), (second, 0.4)]
    inputs = random_inputs(CONFIG, seed=5, **INPUTS)
    expected = _run(_reference(reference, files), inputs)
    fills = []
    original = LoraGroup._fill_wide
    monkeypatch.setattr(LoraGroup, "_fill_wide", lambda self, x: fills.append(1) or original(self, x))
    for tier in ("exact", "lossless"):
        got, _ = _ours(ours, files, inputs=inputs, tier=tier)
        assert max_rel_err(got, expected) <= TOLERANCE, tier
    # The lossless tier ran q/k/v, the SwiGLU projection and ff.net.2 of every block inside their GEMMs.
    assert len(fills) == 3 * len(ours.transformer_blocks)


def test_a_turbo_shaped_adapter_in_the_lossless_gemms_matches_diffusers(tmp_path):
    """Rank 8 on q, k, v, out and the FFN, an A per projection (LightX2V Turbo's shape): the lossless tier keeps q's
    projected columns left of its input (`LoraGroup._lay_out_wide`) and still matches diffusers."""
    reference, ours = _pair(CONFIG, seed=4)
    shapes = {k: v for k, v in diffusers_shapes(ours).items() if k.endswith(TURBO_MODULES)}
    path = tmp_path / "turbo8.safetensors"
    write_diffusers(path, random_factors(shapes, 8, seed=11), peft=True)
    inputs = random_inputs(CONFIG, seed=8, **INPUTS)
    expected = _run(_reference(reference, [(path, 0.9)]), inputs)
    registry = _registry(ours)
    set_quality(ours, "lossless")
    active = activate(ours, [(registry.adapter(registry.register(path)), 0.9)], "t2va", "cpu")
    got = _run(ours, inputs, "lossless")
    assert max_rel_err(got, expected) <= TOLERANCE
    qkv = [g for g in active.groups if len(g.members) == 3 and g._extended]  # the fused blocks' (not the refiner's)
    assert len(qkv) == len(ours.transformer_blocks) and all(g._left_width == 8 for g in qkv)
    deactivate(ours)


@pytest.mark.parametrize("prefixed", [False, True])
def test_ref2va_adapters_go_to_transformer_ref_as_diffusers_routes_them(prefixed, tmp_path):
    reference, ours = _pair(CONFIG, seed=3)
    shapes = diffusers_shapes(ours)
    path = tmp_path / "ref.safetensors"
    write_diffusers(path, random_factors(shapes, 4, 9), prefix="transformer_ref." if prefixed else "transformer.")
    inputs = random_inputs(CONFIG, seed=6, **INPUTS)
    if prefixed:  # a `transformer_ref.` file on a pipeline holding both partitions
        other = MiniMaxH3Transformer3DModel(**CONFIG)
        holder = diffusers_holder(transformer=other, transformer_ref=reference)
        holder.load_lora_weights(str(path), adapter_name="r")
        expected = _run(reference, inputs)
    else:  # a plain file on ref2va's partition
        expected = _run(_reference(reference, [(path, 1.0)], ref=True), inputs)
    got, registry = _ours(ours, [(path, 1.0)], task="ref2va", inputs=inputs)
    assert max_rel_err(got, expected) <= TOLERANCE
    if prefixed:
        with pytest.raises(RequestError, match="ref2va"):
            activate(ours, [(registry.adapter("ref"), 1.0)], "t2va", "cpu")


def test_diffsynth_qkv_is_deinterleaved_by_the_models_head_size(tmp_path):
    _, ours = _pair(CONFIG)  # 2 heads of 32
    cfg = ours.config
    factors = random_factors(native_shapes(cfg), 4, 11)
    grouped, interleaved = tmp_path / "grouped.safetensors", tmp_path / "interleaved.safetensors"
    write_native(grouped, factors)
    write_native(interleaved, factors, style="diffsynth", head_dim=cfg.attention_head_dim)
    inputs = random_inputs(CONFIG, seed=7, **INPUTS)
    want, _ = _ours(ours, [(grouped, 1.0)], inputs=inputs)
    got, _ = _ours(ours, [(interleaved, 1.0)], inputs=inputs)
    assert read_lora(interleaved, head_dim=32).qkv_layout == "interleaved"
    assert max_rel_err(got, want) <= 1e-6


def _factors(out_features, in_features, rank=8, seed=0, scale=0.05):
    generator = torch.Generator().manual_seed(seed)
    return LoraFactors(
        torch.randn(rank, in_features, generator=generator) * scale,
        torch.randn(out_features, rank, generator=generator) * scale,
        0.5,
    )


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_bases_add_the_dense_lora_update(kind):
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96, bias=True)
    layer = Fp8Linear(dense) if kind == "fp8" else MXFP4Linear.from_linear(dense)
    factors = [_factors(96, 64, seed=1), _factors(96, 64, rank=4, seed=2)]
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        base = layer(x)
        delta = sum(f.scale * (x @ f.down.t()) @ f.up.t() for f in factors)
        group = LoraGroup.build([(layer, factors)], "cpu").attach()
        got = layer(x)
        assert max_rel_err(got - base, delta) <= 1e-5  # bf16 / float rows: the dense update exactly
        if kind == "fp8":  # e4m3 rows from a fused kernel: the update within e4m3 rounding
            rows = quantize_rows(x)
            assert max_rel_err(layer(rows) - layer.__class__.forward(layer, rows), delta) <= 0.08
        group.detach()
        assert torch.equal(layer(x), base)


def test_fast_tier_applies_the_adapter(tmp_path, monkeypatch):
    reference, ours = _pair(CONFIG)
    path = _diffusers_file(tmp_path, ours, "peft")
    merged = copy.deepcopy(ours)
    inputs = random_inputs(CONFIG, seed=8, **INPUTS)
    dense, registry = _ours(ours, [(path, 1.0)], inputs=inputs, tier="lossless")
    fills = []
    original = LoraGroup._fill_wide
    monkeypatch.setattr(LoraGroup, "_fill_wide", lambda self, x: fills.append(1) or original(self, x))
    fast, _ = _ours(ours, [(path, 1.0)], inputs=inputs, tier="fast")  # quantizes `ours` to FP8
    # Inside the GEMMs (`h3gen.lora.wide`): q/k/v, to_out, the SwiGLU projection and ff.net.2 of every block.
    assert len(fills) == 4 * len(ours.transformer_blocks)
    fast_base = _run(ours, inputs, "fast")
    # The same update merged into the dense weights, then the whole model in FP8: the rounding the fast tier gives
    # a model that has these weights. Unmerged, the adapter (A in FP8 like its layer, B in the compute dtype) stays
    # within that rounding of the dense model with the adapter (this test's adapter moves the output by more than
    # its own size, so any mistake in applying it shows); the per-layer sum is checked in
    # test_quantized_bases_add_the_dense_lora_update.
    merge_into(merged, "peft", registry.adapter(registry.names[0]).factors["transformer"], 1.0)
    set_quality(merged, "fast")
    merged_error = max_rel_err(_run(merged, inputs, "fast"), dense)
    assert max_rel_err(fast, dense) <= 1.5 * merged_error and max_rel_err(fast, fast_base) > 0.5


def test_group_projects_the_shared_input_once():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 48, bias=False) for _ in range(3)]
    group = LoraGroup.build([(layer, [_factors(48, 32, seed=i)]) for i, layer in enumerate(layers)], "cpu").attach()
    calls = []
    original = group._project
    group._project = lambda x: calls.append(1) or original(x)
    x = torch.randn(4, 32)
    with torch.no_grad():
        for layer in layers:
            layer(x)
    assert len(calls) == 1 and group._input is None  # one GEMM for the three, no reference kept after
    group.detach()


def test_bad_files_are_refused_naming_the_key_or_module(tmp_path):
    _, ours = _pair(CONFIG)
    registry = _registry(ours)
    shapes = diffusers_shapes(ours)
    factors = random_factors({"transformer_blocks.0.attn.to_q": shapes["transformer_blocks.0.attn.to_q"]}, 4, 0)
    unknown = tmp_path / "unknown.safetensors"
    write_diffusers(unknown, {"transformer_blocks.0.attn.to_z": factors["transformer_blocks.0.attn.to_q"]})
    with pytest.raises(RequestError, match=r"`transformer\.transformer_blocks\.0\.attn\.to_z\.lora_A\.weight`"):
        registry.register(unknown)
    leftover = tmp_path / "leftover.safetensors"
    write_native(
        leftover,
        {
            "blocks.0.attn.qkv_proj": (torch.zeros(4, 64), torch.zeros(192, 4)),
            "blocks.0.attn.rope": (torch.zeros(4, 64), torch.zeros(64, 4)),
        },
    )
    with pytest.raises(RequestError, match=r"key `blocks\.0\.attn\.rope\.lora_A\.weight`") as error:
        registry.register(leftover)
    assert str(tmp_path) not in str(error.value) and error.value.field == "loras"
    pruned = tmp_path / "pruned.safetensors"
    write_diffusers(pruned, {"transformer_blocks.1.ff.net.2": (torch.zeros(4, 100), torch.zeros(64, 4))})
    with pytest.raises(
        RequestError,
        match=r"`transformer_blocks\.1\.ff\.net\.2` updates a 64 x 100 weight, but the "
        r"model's is 64 x 128",
    ):
        registry.register(pruned)
    musubi = tmp_path / "musubi.safetensors"
    write_native(musubi, {"blocks.0.attn.norm_q": (torch.zeros(4, 64), torch.zeros(64, 4))}, style="musubi")
    with pytest.raises(RequestError, match="lora_unet_blocks_0_attn_norm_q"):
        registry.register(musubi)
    not_lora = tmp_path / "text.safetensors"
    not_lora.write_text("hello")
    with pytest.raises(RequestError, match="not a readable safetensors file"):
        registry.register(not_lora)
    assert registry.names == []
    good = tmp_path / "good.safetensors"
    write_diffusers(good, factors)
    registry.register(good)
    for loras, message in (
        ([("good", float("nan"))], "finite"),
        (["good", "good"], "listed twice"),
        (["missing"], "no LoRA named 'missing'"),
        ("good", "must be a list"),
        ([("good", 1.0, 2.0)], "pair"),
    ):
        with pytest.raises(RequestError, match=message):
            registry.resolve(loras)
    assert lora_budget_bytes("4GiB") == 4 * 2**30
    for value in ("lots", -1):
        with pytest.raises(RequestError, match="lora_gpu_memory must") as error:
            lora_budget_bytes(value)
        assert error.value.field == "lora_gpu_memory"


def test_merge_equals_unmerged_and_is_refused_where_bf16_rounds_it_away(tmp_path):
    reference, ours = _pair(CONFIG)
    path = _diffusers_file(tmp_path, ours, "diffusers")
    inputs = random_inputs(CONFIG, seed=9, **INPUTS)
    unmerged, registry = _ours(ours, [(path, 0.5)], inputs=inputs)
    merged_model = copy.deepcopy(ours)
    merge_into(merged_model, "diffusers", registry.adapter("diffusers").factors["transformer"], 0.5)
    assert max_rel_err(_run(merged_model, inputs), unmerged) <= 1e-5
    # bf16 weights of size ~0.2 and an update of ~1e-5: rounding keeps none of it.
    bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    before = {k: v.clone() for k, v in bf16.state_dict().items()}
    with pytest.raises(RequestError, match=r"would lose \d+% of its update on `.*` \(more than 50%\)") as error:
        merge_into(bf16, "diffusers", registry.adapter("diffusers").factors["transformer"], 1e-6)
    assert error.value.field == "merge"
    assert all(torch.equal(before[k], v) for k, v in bf16.state_dict().items())  # nothing changed
    merge_into(bf16, "diffusers", registry.adapter("diffusers").factors["transformer"], 1.0)  # large: merges
    set_quality(bf16, "fast")
    with pytest.raises(RequestError, match="not dense"):
        merge_into(bf16, "diffusers", registry.adapter("diffusers").factors["transformer"], 1.0)


# ---------------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def adapter_files(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    model = H3Transformer.from_pretrained(tiny_dir / "transformer", torch_dtype=torch.float32)
    shapes = diffusers_shapes(model)
    paths = []
    for seed, name in ((1, "style"), (2, "subject")):
        path = folder / f"{name}.safetensors"
        write_diffusers(path, random_factors(shapes, 4, seed, scale=0.5))
        paths.append(path)
    return paths


def test_pipeline_switches_adapters_between_requests_without_reloading(tiny_dir, adapter_files):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, max_cpu_loras=1)
    style, subject = adapter_files
    assert pipe.load_lora(style) == "style"
    weights = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    kwargs = dict(seed=3, num_inference_steps=3, num_frames=130, decode=False)

    def latents(**extra):
        captured = []
        handle = pipe.transformer.proj_out.register_forward_hook(lambda m, a, out: captured.append(out.clone()))
        output = pipe("a fox", **kwargs, **extra)
        handle.remove()
        return torch.cat([c.flatten() for c in captured]), output

    plain, output = latents()
    assert output.loras == []
    first, output = latents(loras=["style"])
    assert output.loras == [("style", 1.0)] and max_rel_err(first, plain) > 0.01
    second, output = latents(loras=[(str(subject), 0.5), ("style", 0.25)])  # a path, loaded on first use
    assert output.loras == [("subject", 0.5), ("style", 0.25)]
    assert max_rel_err(second, first) > 0.01
    assert pipe.loras.cached == ["style"]  # max_cpu_loras=1: the LRU holds the last one used
    again, _ = latents(loras=["style"])
    assert torch.equal(again, first)
    back, _ = latents()
    assert torch.equal(back, plain)
    assert all(torch.equal(weights[k], v) for k, v in pipe.transformer.state_dict().items())


def test_pipeline_refuses_adapters_over_the_gpu_budget_before_any_work(tiny_dir, adapter_files):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, lora_gpu_memory="64KiB")
    stages = []
    with pytest.raises(
        RequestError,
        match=r"the 2 LoRA adapters \(style, subject\) need [\d.]+ KiB on the device, "
        r"more than the 64.0 KiB they may use \(lora_gpu_memory\)",
    ) as error:
        pipe(
            "a fox",
            seed=1,
            num_inference_steps=2,
            loras=[str(p) for p in adapter_files],
            callback=lambda *args: stages.append(args),
        )
    assert error.value.field == "loras" and stages == []


GiB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's memory figures, set by the test: the driver's free bytes and the allocator's reserved and
    allocated bytes."""
    state = dict(free=10 * GiB, reserved=6 * GiB, allocated=GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    return state


def test_free_device_memory_counts_the_allocators_cache_and_a_busy_pipeline_uses_the_last_figure(fake_cuda):
    assert available_device_memory("cuda") == 15 * GiB  # 10 free + 5 cached by PyTorch's allocator, unused
    assert available_device_memory("cpu") is None
    held = {"transformer": GiB}
    memory = DeviceMemory("cuda", held=lambda: dict(held))
    assert memory.available("transformer") == 16 * GiB and memory.available("transformer_ref") == 15 * GiB
    fake_cuda["free"] = 20 * GiB
    assert memory.available("transformer") == 26 * GiB  # idle: measured live
    with memory.running():
        fake_cuda.update(free=GiB, reserved=40 * GiB, allocated=40 * GiB)  # the call's activations fill the device
        held["transformer"] = 3 * GiB  # and it switched adapter sets
        assert memory.available("transformer") == 26 * GiB  # the figure from before the call
        second = memory.running()
        second.__enter__()  # a call overlapping the first
        fake_cuda.update(reserved=41 * GiB)
    assert memory.available("transformer") == 5 * GiB  # taken when the first call ended: 1 + 1 cached + 3 held
    fake_cuda.update(free=30 * GiB)
    assert memory.available("transformer") == 5 * GiB  # the second still runs
    second.__exit__(RuntimeError, RuntimeError("stopped"), None)  # it ends with an error
    fake_cuda.update(free=50 * GiB)
    assert memory.available("transformer") == 54 * GiB  # idle again, however the call ended: live


def test_pipeline_checks_adapter_files_against_free_memory_live_when_idle_else_from_the_last_call(
    tiny_dir, adapter_files, fake_cuda
):
    from h3gen.pipelines.h3.pipeline import H3Pipeline

    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    lora = read_lora(adapter_files[0], head_dim=pipe.config.attention_head_dim)
    need = lora_device_bytes(lora, "t2va", 4)
    pipe.validate("a fox", seed=1, lora_files=[lora])  # on the CPU: no cap
    pipe.adapters.device_memory = DeviceMemory("cuda", held=pipe.device_memory.held)  # the CPU model, CUDA's figures
    fake_cuda.update(free=LORA_GPU_RESERVE + need - 1, reserved=0, allocated=0)
    with pytest.raises(
        RequestError,
        match=r"the 1 LoRA adapters \(style\) need [\d.]+ KiB on the device, more than "
        r"the [\d.]+ KiB they may use \(free device memory less 2 GiB\)",
    ) as error:
        pipe.validate("a fox", seed=1, lora_files=[lora])
    assert error.value.field == "loras"
    fake_cuda.update(reserved=GiB, allocated=GiB - 1)  # one byte cached by the allocator is enough
    pipe.validate("a fox", seed=1, lora_files=[lora])
    fake_cuda.update(free=8 * GiB)
    checked = []

    def busy(stage, step, total):  # another request arrives while this call's activations fill the device
        if stage == "denoise" and not checked:
            fake_cuda.update(free=0, reserved=0, allocated=0)
            pipe.validate("a fox", seed=1, lora_files=[lora])
            checked.append(stage)

    pipe("a fox", seed=1, num_inference_steps=2, num_frames=130, decode=False, callback=busy)
    assert checked
    with pytest.raises(RequestError, match="free device memory less 2 GiB"):
        pipe.validate("a fox", seed=1, lora_files=[lora])  # idle: the device is full now
    with pytest.raises(RequestError):
        pipe("a fox", seconds=1000)  # a call that fails still ends as one
    fake_cuda.update(free=8 * GiB)
    pipe.validate("a fox", seed=1, lora_files=[lora])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_header_bytes_are_what_activate_holds(dtype, tmp_path):
    _, ours = _pair(CONFIG)
    ours.to(dtype)
    plain = FORMATS["diffusers"][1](tmp_path, ours)  # q, k and v with A's of their own
    fused = FORMATS["kohya"][1](tmp_path, ours)  # a fused QKV: q, k and v share one A
    files = {path: read_lora(path, head_dim=ours.config.attention_head_dim) for path in (plain, fused)}
    assert files[plain].qkv_layout is None and files[fused].qkv_layout == "grouped"
    registry = _registry(ours)
    adapters = {path: (registry.adapter(registry.register(path)), 1.0) for path in files}
    for chosen in ([plain], [fused], [plain, fused]):
        held = activate(ours, [adapters[path] for path in chosen], "t2va", "cpu").nbytes
        # Before a forward no weight is extended: the count without extended weights, exactly.
        assert sum(lora_device_bytes(files[path], "t2va", dtype.itemsize, extended=False) for path in chosen) == held
        deactivate(ours)


def test_header_bytes_bound_what_the_lossless_tier_holds(tmp_path):
    """After a lossless forward the blocks' q/k/v, SwiGLU projection and ff.net.2 groups hold extended weights
    (`h3gen.lora.wide`): with a fused-QKV file (one A per group) the header's count is exact, with A's of their own
    an upper bound (q reads the fewest columns)."""
    _, ours = _pair(CONFIG)
    plain = FORMATS["diffusers"][1](tmp_path, ours)
    fused = FORMATS["kohya"][1](tmp_path, ours)
    registry = _registry(ours)
    set_quality(ours, "lossless")
    inputs = random_inputs(CONFIG, seed=3, **INPUTS)
    for path in (fused, plain):
        lora = read_lora(path, head_dim=ours.config.attention_head_dim)
        active = activate(ours, [(registry.adapter(registry.register(path)), 1.0)], "t2va", "cpu")
        before = active.nbytes
        _run(ours, inputs, "lossless")
        extended = [g for g in active.groups if any(m.wide_weight is not None for m in g.members)]
        assert len(extended) == 3 * len(ours.transformer_blocks) and active.nbytes > before
        header = lora_device_bytes(lora, "t2va", 4)
        assert active.nbytes == header if path == fused else before < active.nbytes < header
        assert lora_device_bytes(lora, "t2va", 4, extended=False) == before
        deactivate(ours)


def test_header_bytes_bound_what_the_fast_tier_holds(tmp_path):
    _, ours = _pair(CONFIG)
    fused = FORMATS["kohya"][1](tmp_path, ours)
    lora = read_lora(fused, head_dim=ours.config.attention_head_dim)
    registry = _registry(ours)
    set_quality(ours, "fast")
    fp8 = fp8_layers(ours)
    assert "transformer_blocks.0.attn.to_q" in fp8 and "transformer_blocks.0.adaln_proj.linear" not in fp8
    active = activate(ours, [(registry.adapter(registry.register(fused)), 1.0)], "t2va", "cpu")
    # Before a forward: the dense factors only.
    assert active.nbytes == lora_device_bytes(lora, "t2va", 4, extended=False)
    _run(ours, random_inputs(CONFIG, seed=3, **INPUTS), "fast")  # e4m3 rows: FP8 copies of A, extended weights
    header = lora_device_bytes(lora, "t2va", 4, fp8)
    # Every FP8 group made its copy of A (rank 4 padded to 16 rows) and extended its members by 16 e4m3 columns.
    assert all(
        g.wide and all(m.wide_weight is not None for m in g.members)
        for g in active.groups
        if g.members[0].layer.weight.dtype == torch.float8_e4m3fn
    )
    assert active.nbytes == header
    deactivate(ours)


def test_header_bytes_follow_the_ref2va_routing(tmp_path):
    _, ours = _pair(CONFIG)
    shapes = {k: v for k, v in diffusers_shapes(ours).items() if k.endswith(".attn.to_q")}
    per_file = {}
    for prefix, rank in (("transformer.", 2), ("transformer_ref.", 4)):
        path = tmp_path / f"{prefix}safetensors"
        write_diffusers(path, random_factors(shapes, rank, 1), prefix=prefix)
        per_file[prefix] = sum(rank * (rows + cols) * 2 for rows, cols in shapes.values())
    ref_only = read_lora(tmp_path / "transformer_ref.safetensors", head_dim=32)
    assert lora_device_bytes(ref_only, "ref2va", 2, extended=False) == per_file["transformer_ref."]
    for task in ("t2va", "fl2va"):
        with pytest.raises(RequestError, match=r"holds transformer_ref \(ref2va\) layers only") as error:
            lora_device_bytes(ref_only, task, 2)
        assert error.value.field == "loras"
    both = read_lora(tmp_path / "transformer.safetensors", head_dim=32)
    both.targets += ref_only.targets
    assert lora_device_bytes(both, "t2va", 2, extended=False) == per_file["transformer."]
    assert lora_device_bytes(both, "ref2va", 2, extended=False) == per_file["transformer_ref."]


def test_pipeline_adapters_under_layerwise_offload_and_merged(tmp_path):
    from h3gen.pipelines.h3.pipeline import H3Pipeline
    from h3gen.pipelines.h3.tiny_checkpoint import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "four_blocks", transformer=dict(num_layers=4))
    resident = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)
    path = tmp_path / "style.safetensors"
    write_diffusers(path, random_factors(diffusers_shapes(resident.transformer), 4, 1, scale=0.5))
    kwargs = dict(seed=4, num_inference_steps=3, num_frames=130, loras=[(str(path), 0.8)])
    expected = resident("a fox", **kwargs)
    model = resident.transformer
    other = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("transformer_blocks.")
    )
    block = sum(
        p.numel() * p.element_size()
        for n, p in model.transformer_blocks[0].named_parameters()
        if not n.startswith("adaln_proj")
    )
    offloaded = H3Pipeline.from_pretrained(
        folder,
        device="cpu",
        torch_dtype=torch.float32,
        offload="layerwise",
        gpu_memory=int((other + 2 * block) / 0.8) + 1,
        prefetch=1,
    )
    assert offloaded.transformer.offload_plan.streamed  # the blocks really stream
    clip = offloaded("a fox", **kwargs)
    assert np.abs(clip.video - expected.video).max() <= 1e-5 and np.abs(clip.audio - expected.audio).max() <= 1e-5
    merged = H3Pipeline.from_pretrained(folder, device="cpu", torch_dtype=torch.float32)
    merged.load_lora(path, merge=True, scale=0.8)
    clip = merged("a fox", seed=4, num_inference_steps=3, num_frames=130)
    assert clip.loras == [("style", 0.8)]
    assert np.abs(clip.video - expected.video).max() <= 1e-4


def test_a_set_is_rehooked_when_its_layers_were_replaced_and_paths_get_their_own_names(tmp_path):
    _, ours = _pair(CONFIG)
    path = _diffusers_file(tmp_path, ours, "peft")
    registry = _registry(ours)
    adapters = registry.resolve([str(path)])
    activate(ours, adapters, "t2va", "cpu")
    set_quality(ours, "fast")  # the block linears become new Fp8Linear modules
    activate(ours, adapters, "t2va", "cpu")
    to_q = ours.transformer_blocks[0].attn.to_q
    assert isinstance(to_q, Fp8Linear) and to_q.lora_group is not None
    other = tmp_path / "other"
    other.mkdir()
    same_stem = other / path.name
    same_stem.write_bytes(path.read_bytes())
    assert [a.name for a, _ in registry.resolve([str(path), str(same_stem)])] == ["peft", "peft-2"]


def test_a_shared_a_is_projected_once_and_stacking_stays_exact():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 48, bias=False) for _ in range(3)]
    shared = _factors(48, 32, seed=1)
    own = [_factors(48, 32, rank=4, seed=2 + i) for i in range(3)]
    members = [(layer, [LoraFactors(shared.down, torch.randn(48, 8), 0.3), own[i]]) for i, layer in enumerate(layers)]
    x = torch.randn(5, 32)
    with torch.no_grad():
        base = [layer(x) for layer in layers]
        group = LoraGroup.build(members, "cpu").attach()
        assert group.down.shape[0] == 8 + 3 * 4  # the shared A once, then each member's own
        for layer, (_, factors), plain in zip(layers, members, base, strict=True):
            want = plain + sum(f.scale * (x @ f.down.t()) @ f.up.t() for f in factors)
            assert max_rel_err(layer(x), want) <= 1e-6
        group.detach()


def test_a_dense_linear_writes_the_update_first_and_gets_its_forward_back():
    """On an `nn.Linear` the update (and bias) is written first and the layer's GEMM adds into it; detaching
    restores the class's forward. The other bases keep a forward hook."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 48, bias=True)
    fp8 = Fp8Linear(torch.nn.Linear(32, 48, bias=False))
    factors = [_factors(48, 32, seed=1), _factors(48, 32, rank=4, seed=2)]
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        plain = dense(x)
        group = LoraGroup.build([(dense, factors)], "cpu").attach()
        assert "forward" in vars(dense) and not dense._forward_hooks
        want = plain + sum(f.scale * (x @ f.down.t()) @ f.up.t() for f in factors)
        assert dense(x).shape == (2, 5, 48) and max_rel_err(dense(x), want) <= 1e-6
        group.detach()
        assert "forward" not in vars(dense) and torch.equal(dense(x), plain)
        group = LoraGroup.build([(fp8, factors)], "cpu").attach()
        assert "forward" not in vars(fp8) and len(fp8._forward_hooks) == 1
        group.detach()
        assert not fp8._forward_hooks


def _three_members(layers, shared_a: bool, size: float = 1.0, ranks=(5, 3)):
    """(layer, adapters) for three linears reading one 48-wide input: one A of rank 6 they share (a fused-QKV file's),
    or two adapters of their own each (of `ranks`); `size` scales the first adapter."""
    shared = _factors(32, 48, rank=6, seed=1)
    return [
        (
            layer,
            [LoraFactors(shared.down, torch.randn(layer.out_features, 6) * size, 0.5)]
            if shared_a
            else [
                _factors(layer.out_features, 48, rank=ranks[0], seed=2 + i, scale=size),
                _factors(layer.out_features, 48, rank=ranks[1], seed=9 + i),
            ],
        )
        for i, layer in enumerate(layers)
    ]


def _windows(group) -> list[tuple[int, int]]:
    """Each member's (projected columns left of its input, right of it) in its K-extended window."""
    return [(m.wide_x, m.wide_span[1] - m.wide_span[0] - m.wide_x - m.layer.in_features) for m in group.members]


# (adapters, their ranks): the windows of the three members, and the wide buffer's row width (48 input columns)
FP8_LAYOUTS = {
    "a shared A": (True, (5, 3), [(0, 16)] * 3, 48 + 16),  # 6 projected columns, padded to 16
    "A's of their own": (False, (5, 3), [(0, 16), (0, 16), (0, 32)], 48 + 32),  # 8 each: not whole groups of 16
    "A's of their own, whole groups": (False, (11, 5), [(16, 0), (0, 16), (0, 32)], 16 + 48 + 48),
}


@pytest.mark.parametrize("layout", FP8_LAYOUTS)
@pytest.mark.parametrize("size", [0.05, 5.0])
def test_fp8_members_run_the_update_inside_their_gemm_and_give_their_weights_back(layout, size):
    """With `wide=True` a group of `Fp8Linear`s fed through `wide_input` runs `[x | x A^T]` by `[W | B]` in one
    e4m3 GEMM per member (the first member's columns left of x where they fill whole groups of 16): the base plus
    the dense update within e4m3 rounding, for a small adapter and for one whose projections pass 448 (rows then
    take a larger scale: nothing saturates). Any other input takes the update after the GEMM; detaching gives the
    layers their weights back, contiguous and unchanged."""
    shared_a, ranks, windows, width = FP8_LAYOUTS[layout]
    torch.manual_seed(0)
    layers = [Fp8Linear(torch.nn.Linear(48, 32 + 16 * i, bias=i == 1)) for i in range(3)]
    members = _three_members(layers, shared_a, size, ranks)
    saved = [layer.weight.clone() for layer in layers]
    x = torch.randn(2, 7, 48) * torch.logspace(-1, 1, 48)
    rows = quantize_rows(x)
    dequantized = rows.values.float() * rows.scale.reshape(2, 7, 1)
    with torch.no_grad():
        base = [layer(rows) for layer in layers]
        delta = [sum(f.scale * (dequantized @ f.down.t()) @ f.up.t() for f in factors) for _, factors in members]
        group = LoraGroup.build(members, "cpu", wide=True).attach()
        assert group.wide and _windows(group) == windows
        for _ in range(2):
            wide = wide_input(layers[0], x.shape, "cpu")
            assert quantize_rows(x, out=wide) is wide and wide.values.stride(-2) == width
            got = [layer(wide) for layer in layers]
            assert group._wide_x is None and group._input is None
            for out, plain, update in zip(got, base, delta, strict=True):
                assert torch.isfinite(out).all() and max_rel_err(out - plain, update) <= 0.1
        grown = (wide.scale / rows.scale).flatten()
        assert (grown > 1).any() == (size > 1)  # the large adapter's projections needed larger row scales
        hooked = layers[1](rows)  # not the wide input: the update added after the GEMM
        assert max_rel_err(hooked - base[1], delta[1]) <= 0.1
        group.detach()
        for layer, before in zip(layers, saved, strict=True):
            assert layer.weight.is_contiguous() and torch.equal(
                layer.weight.view(torch.uint8), before.view(torch.uint8)
            )
            assert "forward" not in vars(layer)
        assert wide_input(layers[0], x.shape, "cpu") is None


DENSE_LAYOUTS = {
    "a shared A": (True, (5, 3), [(0, 8)] * 3, 48 + 8),  # 6 projected columns, padded to 8
    "A's of their own": (False, (5, 3), [(8, 0), (0, 8), (0, 16)], 8 + 48 + 24),  # q's 8 left of x as well
    "A's of their own, not whole groups": (False, (4, 3), [(0, 8), (0, 16), (0, 24)], 48 + 24),  # 7 each
}


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_dense_members_run_the_update_inside_their_gemm_and_give_their_weights_back(layout):
    """With `wide=True` a group of dense linears fed through `wide_input` runs `[x | x A^T]` by `[W | scale B]` in one
    GEMM per member (the first member's columns left of x where they fill whole groups of 8): the base plus the
    update as the update-first forward computes it. Any other input takes the update written first; detaching
    gives the layers their weights back (the same parameters, contiguous)."""
    shared_a, ranks, windows, width = DENSE_LAYOUTS[layout]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(48, 32 + 16 * i, bias=i == 1) for i in range(3)]
    members = _three_members(layers, shared_a, ranks=ranks)
    parameters = [layer.weight for layer in layers]
    saved = [layer.weight.detach().clone() for layer in layers]
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        base = [layer(x) for layer in layers]
        delta = [sum(f.scale * (x @ f.down.t()) @ f.up.t() for f in factors) for _, factors in members]
        group = LoraGroup.build(members, "cpu", wide=True).attach()
        assert group.wide and _windows(group) == windows
        for _ in range(2):
            wide = wide_input(layers[0], x.shape, "cpu")
            assert wide.stride(-2) == width
            wide.copy_(x)
            got = [layer(wide) for layer in layers]
            assert group._wide_x is None and group._input is None
            for out, plain, update in zip(got, base, delta, strict=True):
                assert max_rel_err(out - plain, update) <= 1e-5
        assert all(
            m.wide_weight is not None and m.layer.weight.data_ptr() == m.wide_weight[:, m.wide_x :].data_ptr()
            for m in group.members
        )
        assert max_rel_err(layers[1](x) - base[1], delta[1]) <= 1e-5  # not the wide input: the update first
        group.detach()
        for layer, parameter, before in zip(layers, parameters, saved, strict=True):
            assert layer.weight is parameter and layer.weight.is_contiguous() and torch.equal(layer.weight, before)
            assert "forward" not in vars(layer)
        assert wide_input(layers[0], x.shape, "cpu") is None


def test_a_file_diffusers_saved_with_its_peft_config_is_scaled_as_that_config_says(tmp_path):
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
    from peft import LoraConfig, get_peft_model_state_dict

    trained, ours = _pair(CONFIG)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        rank_pattern={"adaln_proj.linear": 2},
        alpha_pattern={"to_out.0": 3.0, "^transformer_blocks.1.ff.net.2": 16.0},
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "adaln_proj.linear"],
    )
    trained.add_adapter(config)
    state = get_peft_model_state_dict(trained)
    metadata = trained.peft_config["default"].to_dict()
    MiniMaxH3LoraLoaderMixin.save_lora_weights(
        tmp_path, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
    )
    path = tmp_path / "pytorch_lora_weights.safetensors"
    lora = read_lora(path, head_dim=32)
    assert lora.alpha_source == "adapter-config" and lora.ranks == [2, 4]
    reference, _ = _pair(CONFIG)
    inputs = random_inputs(CONFIG, seed=12, **INPUTS)
    expected = _run(_reference(reference, [(path, 1.0)]), inputs)
    assert max_rel_err(expected, _run(trained, inputs)) <= 1e-5  # diffusers reloads what it saved
    got, _ = _ours(ours, [(path, 1.0)], inputs=inputs)
    assert max_rel_err(got, expected) <= TOLERANCE


@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf"])
def test_a_non_finite_alpha_is_refused_when_read_and_when_given(tmp_path, alpha):
    """What is accepted must run: a metadata alpha "nan" (or an override) would fill the clip with NaN at its
    end, so the file is refused from its header, naming it, and so is such an alpha given at load."""
    _, ours = _pair(CONFIG)
    factors = random_factors({k: v for k, v in diffusers_shapes(ours).items() if k.endswith(TURBO_MODULES)}, 4, 2)
    path = tmp_path / "style.safetensors"
    write_diffusers(path, factors, peft=True, metadata={"alpha": alpha})
    with pytest.raises(RequestError, match="style: its metadata alpha .* is not a finite number"):
        read_lora(path)
    write_diffusers(path, factors, peft=True)
    with pytest.raises(RequestError, match="the alpha given is not a finite number"):
        read_lora(path, alpha=float(alpha))
