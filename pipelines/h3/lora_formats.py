"""MiniMax-H3 LoRA files: which format a file is, which transformer module each of its tensors updates, with which
alpha, converted exactly as diffusers 0.42.1's `MiniMaxH3LoraLoaderMixin.lora_state_dict` and
`_convert_non_diffusers_minimax_h3_lora_to_diffusers` convert them (diffusers' `loaders/lora_pipeline.py` and
`loaders/lora_conversion_utils.py`).

Formats (detected in diffusers' order):
  - "native": the original checkpoint's module names (`blocks.N.attn.qkv_proj`, `mlp.fc1`, `token_refiner.blocks.N`,
    `final_layer.*`, the embedders), optionally under `diffusion_model.`; "kohya" when its factors are
    `lora_down` / `lora_up` (with `.alpha` tensors), "musubi" for kohya's flattened `lora_unet_<module>` names,
    "diffsynth" for native names with peft's `.default.` infix (fused QKV in the per-head interleaved layout);
  - "peft": diffusers module names with `.default.` and no component prefix (LightX2V's Turbo files);
  - "diffusers": `transformer.` / `transformer_ref.`-prefixed diffusers module names.
Conversions: fused `qkv_proj` -> `to_q` / `to_k` / `to_v` (A shared, B cut in thirds after de-interleaving an
interleaved B per head, by the model's head size), `mlp.fc1` -> `ff.net.0.proj` with B's halves swapped from
`[gate; value]` to `[value; gate]`, `attn.out_proj` -> `attn.to_out.0`, `mlp.fc2` -> `ff.net.2`, the stand-alone
projections renamed. A key nothing consumes is an error naming it.

Alpha (each module is scaled by alpha / its own rank): an `alpha=` given at load time, as a uniform network alpha;
else per-module `.alpha` tensors (a file with any of them gives the others alpha = rank, as diffusers does); else a
numeric `alpha` in the safetensors metadata; else 8 for files named like LightX2V's Turbo v0.1
(`minimax_h3_*_turbo_4step_v0.1*`, which declare none and were trained with their script's default alpha 8); else
alpha = rank.

A file diffusers itself saved with its PEFT `LoraConfig` (`lora_adapter_metadata`) is scaled as that config says,
after an `alpha=` override and `.alpha` tensors, before a metadata `alpha`.

`read_lora` reads a file's header only (names, shapes, metadata); `load_lora_factors` reads the tensors.
"""

import fnmatch
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from h3gen.errors import RequestError
from h3gen.lora import LoraFactors
from h3gen.pipelines.h3.fasth3_adapter import ADAPTER_FORMAT, refuse_per_request

logger = logging.getLogger(__name__)

PARTITIONS = ("transformer", "transformer_ref")
NATIVE_PREFIXES = ("diffusion_model.", "blocks.", "token_refiner.blocks.", "final_layer.", "lora_unet_")
TURBO_V01_PATTERN = "minimax_h3_*_turbo_4step_v0.1*"
TURBO_V01_ALPHA = 8.0

# musubi-tuner / kohya: a flattened module name -> its dotted native name (the whole name must match one).
FLATTENED_MODULES = [
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
]
STANDALONE_RENAMES = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
}
BLOCK_MODULES = (
    ("attn.out_proj", "attn.to_out.0"),
    ("mlp.fc2", "ff.net.2"),
    ("adaln_proj.linear", "adaln_proj.linear"),
)
BLOCK_STACKS = (
    (r"blocks\.(\d+)\.", "blocks", "transformer_blocks"),
    (r"token_refiner\.blocks\.(\d+)\.", "token_refiner.blocks", "token_refiner.refiner_blocks"),
)


@dataclass(frozen=True)
class LoraTarget:
    """One module update a file holds: `module` (diffusers name inside `partition`), where its factors are in the
    file and how they are transformed ("plain", "q" / "k" / "v" for a third of a fused QKV, "fc1" for the swapped
    SwiGLU halves), its rank and the shape of the weight it updates."""

    partition: str
    module: str
    down_key: str
    up_key: str
    alpha_key: str | None
    transform: str
    rank: int
    in_features: int
    out_features: int


@dataclass
class LoraFile:
    """What a LoRA file is, read from its header without loading its tensors.

    `name`: the file's stem; `format`: see the module docstring; `targets`: every module update (`LoraTarget`);
    `ranks`: the distinct ranks; `alpha`: the uniform network alpha every module is scaled with (alpha / its rank),
    or None where the modules' own `.alpha` tensors, the adapter config or alpha = rank apply; `alpha_source`:
    "override", "module", "adapter-config", "metadata", "turbo-v0.1" or "rank"; `metadata`: the safetensors
    `__metadata__`; `partitions`: the transformer partitions its keys name ("transformer" for every unprefixed format);
    `qkv_layout`: "grouped" or "interleaved" for a fused-QKV file, else None.
    """

    path: Path
    name: str
    format: str
    targets: list[LoraTarget]
    alpha: float | None
    alpha_source: str
    metadata: dict[str, str] = field(default_factory=dict)
    qkv_layout: str | None = None
    nbytes: int = 0
    config_scales: dict[tuple[str, str], float] = field(default_factory=dict)  # (partition, module) -> scale

    @property
    def partitions(self) -> tuple[str, ...]:
        return tuple(p for p in PARTITIONS if any(t.partition == p for t in self.targets))

    @property
    def ranks(self) -> list[int]:
        return sorted({t.rank for t in self.targets})

    @property
    def modules(self) -> list[str]:
        return [t.module for t in self.targets]

    def module_scale(self, target: LoraTarget, alpha_tensor: float | None) -> float:
        """The factor `target`'s `B A` is scaled with: alpha / rank by the rules of the module docstring."""
        if self.alpha is not None:
            return self.alpha / target.rank
        if self.alpha_source == "adapter-config":
            return self.config_scales[(target.partition, target.module)]
        if alpha_tensor is not None and not math.isfinite(alpha_tensor):
            raise _bad(self.name, f"the .alpha of {target.module} is not a finite number ({alpha_tensor}).")
        return (alpha_tensor if alpha_tensor is not None else float(target.rank)) / target.rank


def _bad(name: str, message: str) -> RequestError:
    return RequestError(f"LoRA {name}: {message}", "loras")


def _unflatten(key: str, name: str) -> str:
    module, _, suffix = key.removeprefix("lora_unet_").partition(".")
    for pattern, replacement in FLATTENED_MODULES:
        if re.fullmatch(pattern, module):
            return f"{re.sub(pattern, replacement, module)}.{suffix}"
    raise _bad(name, f"key `{key}` does not name a MiniMax-H3 module in musubi-tuner's flattened `lora_unet_` layout.")


class _Header:
    """A file's keys -> shapes, consumed as the conversion claims them (what is left over is an error)."""

    def __init__(self, shapes: dict[str, list[int]], name: str):
        self.shapes, self.name = shapes, name
        self.source: dict[str, str] = {k: k for k in shapes}  # converted key -> key in the file

    def rename(self, mapping) -> None:
        renamed = {}
        for key, shape in self.shapes.items():
            new = mapping(key)
            renamed[new] = shape
            self.source[new] = self.source.pop(key) if new != key else self.source[key]
        self.shapes = renamed

    def pop(self, key: str) -> tuple[str, list[int]] | None:
        if key not in self.shapes:
            return None
        return self.source.pop(key), self.shapes.pop(key)


def _native_targets(header: _Header, head_dim: int, qkv_layout: str | None) -> tuple[list[LoraTarget], str, str]:
    """Targets of a native-name file (diffusers' `_convert_non_diffusers_minimax_h3_lora_to_diffusers`), its
    format name and QKV layout."""
    name = header.name
    header.rename(lambda k: k.removeprefix("diffusion_model."))
    diffsynth = any(".lora_A.default.weight" in k or ".lora_B.default.weight" in k for k in header.shapes)
    if diffsynth:
        header.rename(lambda k: k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."))
    musubi = any(k.startswith("lora_unet_") for k in header.shapes)
    if musubi:
        header.rename(lambda k: _unflatten(k, name) if k.startswith("lora_unet_") else k)
    kohya = any(".lora_down.weight" in k for k in header.shapes)
    down_suffix, up_suffix = (".lora_down.weight", ".lora_up.weight") if kohya else (".lora_A.weight", ".lora_B.weight")
    layout = qkv_layout or ("interleaved" if diffsynth else "grouped")
    targets: list[LoraTarget] = []

    def pull(base: str):
        down = header.pop(base + down_suffix)
        if down is None:
            return None
        up = header.pop(base + up_suffix)
        if up is None:
            raise _bad(name, f"`{down[0]}` has no matching `{base + up_suffix}`.")
        alpha = header.pop(base + ".alpha")
        return down, up, alpha[0] if alpha else None

    def add(module: str, pair, transform: str = "plain", out_features: int | None = None):
        (down_key, down_shape), (up_key, up_shape), alpha_key = pair
        if len(down_shape) != 2 or len(up_shape) != 2 or up_shape[1] != down_shape[0]:
            raise _bad(
                name,
                f"`{down_key}` {down_shape} and `{up_key}` {up_shape} are not a LoRA pair "
                "(A (rank, in), B (out, rank)).",
            )
        targets.append(
            LoraTarget(
                "transformer",
                module,
                down_key,
                up_key,
                alpha_key,
                transform,
                down_shape[0],
                down_shape[1],
                out_features if out_features is not None else up_shape[0],
            )
        )

    for source, target in STANDALONE_RENAMES.items():
        pair = pull(source)
        if pair is not None:
            add(target, pair)
    for pattern, source_prefix, target_prefix in BLOCK_STACKS:
        layers = [int(m.group(1)) + 1 for k in header.shapes if (m := re.match(pattern, k))]
        for i in range(max(layers, default=0)):
            source, target = f"{source_prefix}.{i}", f"{target_prefix}.{i}"
            qkv = pull(f"{source}.attn.qkv_proj")
            if qkv is not None:
                rows = qkv[1][1][0]
                if rows % 3:
                    raise _bad(
                        name,
                        f"`{source}.attn.qkv_proj` has {rows} output rows, which is not divisible by "
                        "3: not a fused MiniMax-H3 QKV projection.",
                    )
                if layout == "interleaved" and rows % (3 * head_dim):
                    raise _bad(
                        name,
                        f"`{source}.attn.qkv_proj` has {rows} output rows, not a multiple of 3 x the "
                        f"model's head size {head_dim}: not a per-head-interleaved QKV projection.",
                    )
                for part in ("q", "k", "v"):
                    add(f"{target}.attn.to_{part}", qkv, part, rows // 3)
            fc1 = pull(f"{source}.mlp.fc1")
            if fc1 is not None:
                if fc1[1][1][0] % 2:
                    raise _bad(
                        name,
                        f"`{source}.mlp.fc1` has {fc1[1][1][0]} output rows, which is not even: not "
                        "a fused MiniMax-H3 SwiGLU projection.",
                    )
                add(f"{target}.ff.net.0.proj", fc1, "fc1")
            for source_module, target_module in BLOCK_MODULES:
                pair = pull(f"{source}.{source_module}")
                if pair is not None:
                    add(f"{target}.{target_module}", pair)
    fmt = "musubi" if musubi else "kohya" if kohya else "diffsynth" if diffsynth else "native"
    has_qkv = any(t.transform in ("q", "k", "v") for t in targets)
    return targets, fmt, layout if has_qkv else None


def _diffusers_targets(header: _Header, unprefixed: bool) -> list[LoraTarget]:
    """Targets of a diffusers-named file (prefixed, or a peft dump: `.default.` dropped, `transformer.` added)."""
    if unprefixed:
        header.rename(lambda k: f"transformer.{k.replace('.default.', '.')}")
    targets = []
    for key in sorted(header.shapes):
        if not key.endswith(".lora_A.weight"):
            continue
        partition, _, rest = key.partition(".")
        if partition not in PARTITIONS:
            continue
        module = rest.removesuffix(".lora_A.weight")
        down = header.pop(key)
        up = header.pop(f"{partition}.{module}.lora_B.weight")
        if up is None:
            raise _bad(header.name, f"`{down[0]}` has no matching lora_B.")
        alpha = header.pop(f"{partition}.{module}.alpha")
        if len(down[1]) != 2 or len(up[1]) != 2 or up[1][1] != down[1][0]:
            raise _bad(
                header.name,
                f"`{down[0]}` {down[1]} and `{up[0]}` {up[1]} are not a LoRA pair (A (rank, in), B (out, rank)).",
            )
        targets.append(
            LoraTarget(
                partition,
                module,
                down[0],
                up[0],
                alpha[0] if alpha else None,
                "plain",
                down[1][0],
                down[1][1],
                up[1][0],
            )
        )
    return targets


def _number(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's `get_pattern_key`: the first pattern matching the end of `module` (a dotted suffix) gives its value."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _adapter_config_scales(metadata: dict[str, str], targets: list[LoraTarget]) -> dict[tuple[str, str], float]:
    """Per-module scales from the PEFT `LoraConfig` diffusers' `save_lora_weights` records as JSON under the
    `lora_adapter_metadata` metadata key (`<partition>.r`, `.lora_alpha`, `.rank_pattern`, `.alpha_pattern`,
    `.use_rslora`), as PEFT derives them: alpha / r, or alpha / sqrt(r) with rsLoRA. Empty without one."""
    try:
        config = json.loads(metadata.get("lora_adapter_metadata") or "null")
    except ValueError:
        return {}
    if not isinstance(config, dict):
        return {}
    scales = {}
    for target in targets:

        def get(key, default=None, target=target):
            return config.get(f"{target.partition}.{key}", default)

        if get("r") is None:
            continue
        rank = _pattern_value(get("rank_pattern") or {}, target.module, get("r"))
        alpha = _pattern_value(get("alpha_pattern") or {}, target.module, get("lora_alpha", rank))
        scales[(target.partition, target.module)] = alpha / (math.sqrt(rank) if get("use_rslora") else rank)
    return scales if len(scales) == len(targets) else {}


def read_lora(path, *, head_dim: int = 128, alpha: float | None = None, name: str | None = None) -> LoraFile:
    """Read a LoRA file's header (keys, shapes, metadata; no tensor data) and convert its names.

    Args:
        path: a `.safetensors` file.
        head_dim: the model's attention head size (de-interleaves a per-head-interleaved fused QKV).
        alpha: a uniform network alpha replacing the file's own (each module scaled by alpha / its rank).
        name: the adapter's name (default: the file's stem).
    Raises:
        RequestError (field "loras") naming the first key no conversion consumes, or a malformed pair, or saying
        that a FastH3 adapter (`fastvideo-lora-v2`) merges at load only; messages name the file by its name only.
    """
    path = Path(path)
    name = name or path.stem
    if not path.is_file():
        raise _bad(name, "no such file.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            shapes = {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
            dtypes = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for a file that is not one
        raise _bad(name, f"not a readable safetensors file ({type(error).__name__}).") from None
    if metadata.get("format") == ADAPTER_FORMAT:
        raise refuse_per_request(name)
    dropped = [k for k in shapes if "dora_scale" in k]
    if dropped:
        logger.warning("LoRA %s: ignoring its %d DoRA `dora_scale` tensors, as diffusers does.", name, len(dropped))
        shapes = {k: v for k, v in shapes.items() if "dora_scale" not in k}
    if not shapes:
        raise _bad(name, "the file holds no tensors.")
    has_alpha_tensors = any(k.endswith(".alpha") for k in shapes)
    header = _Header(shapes, name)
    qkv_layout = metadata.get("qkv_layout") if metadata.get("qkv_layout") in ("grouped", "interleaved") else None
    if any(k.startswith(NATIVE_PREFIXES) for k in shapes):
        targets, fmt, qkv_layout = _native_targets(header, head_dim, qkv_layout)
    else:
        unprefixed = any(".default.weight" in k for k in shapes) and not any(
            k.startswith(tuple(f"{p}." for p in PARTITIONS)) for k in shapes
        )
        targets = _diffusers_targets(header, unprefixed)
        fmt, qkv_layout = ("peft" if unprefixed else "diffusers"), None
    if header.shapes:
        first = min(header.shapes)
        raise _bad(
            name,
            f"key `{header.source[first]}` is not part of any MiniMax-H3 LoRA layout this loader "
            "knows (diffusers / peft, native, kohya / musubi, DiffSynth).",
        )
    if not targets:
        raise _bad(name, "the file holds no LoRA factors.")
    config_scales = _adapter_config_scales(metadata, targets)
    if alpha is not None:
        network_alpha, source = float(alpha), "override"
    elif has_alpha_tensors:
        network_alpha, source = None, "module"
    elif config_scales:
        network_alpha, source = None, "adapter-config"
    elif _number(metadata.get("alpha")) is not None:
        network_alpha, source = _number(metadata["alpha"]), "metadata"
    elif fnmatch.fnmatch(path.name, TURBO_V01_PATTERN):
        network_alpha, source = TURBO_V01_ALPHA, "turbo-v0.1"
    else:
        network_alpha, source = None, "rank"
    if "alpha" in metadata and source == "rank":
        logger.warning(
            "LoRA %s records alpha %r in its metadata, which is not a number: loading it with alpha = rank.",
            name,
            metadata["alpha"],
        )
    # What is accepted must run: a non-finite alpha would fill every output with NaN at the end of a job.
    if network_alpha is not None and not math.isfinite(network_alpha):
        given = "the alpha given" if source == "override" else f"its {source} alpha {metadata.get('alpha')!r}"
        raise _bad(name, f"{given} is not a finite number.")
    if not all(math.isfinite(scale) for scale in config_scales.values()):
        raise _bad(name, "its adapter config gives a non-finite lora_alpha or rank.")
    element = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
    nbytes = sum(s[0] * s[1] * element.get(dtypes[k], 4) for k, s in shapes.items() if len(s) == 2)
    return LoraFile(path, name, fmt, targets, network_alpha, source, metadata, qkv_layout, nbytes, config_scales)


def _deinterleave(up: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[head0: q k v, head1: q k v, ...]` rows -> `[q_all; k_all; v_all]`."""
    heads = up.shape[0] // (3 * head_dim)
    grouped = up.reshape(heads, 3 * head_dim, up.shape[1])
    return torch.cat([part.reshape(heads * head_dim, up.shape[1]) for part in grouped.split(head_dim, dim=1)])


def load_lora_factors(
    lora: LoraFile, *, head_dim: int = 128, partitions: tuple[str, ...] = PARTITIONS
) -> dict[str, dict[str, LoraFactors]]:
    """The tensors of `lora`, converted: `{partition: {module: LoraFactors}}` (host tensors in the file's dtype;
    `scale` = the module's alpha / its rank)."""
    out: dict[str, dict[str, LoraFactors]] = {}
    cache: dict[str, torch.Tensor] = {}
    with safe_open(str(lora.path), framework="pt") as handle:

        def get(key: str) -> torch.Tensor:
            if key not in cache:
                cache[key] = handle.get_tensor(key)
            return cache[key]

        for target in lora.targets:
            if target.partition not in partitions:
                continue
            down, up = get(target.down_key), get(target.up_key)
            alpha = float(get(target.alpha_key).item()) if target.alpha_key else None
            if target.transform in ("q", "k", "v"):
                if lora.qkv_layout == "interleaved":
                    key = target.up_key + "#grouped"
                    if key not in cache:
                        cache[key] = _deinterleave(up, head_dim)
                    up = cache[key]
                up = up.chunk(3)["qkv".index(target.transform)].contiguous()
            elif target.transform == "fc1":
                gate, value = up.chunk(2)
                up = torch.cat([value, gate])
            scale = lora.module_scale(target, alpha)
            out.setdefault(target.partition, {})[target.module] = LoraFactors(down, up, scale)
    return out
