"""MiniMax-H3 adapters by name: a host-memory LRU of converted LoRA files (`LoraRegistry`), and switching the set of
adapters a transformer applies (`activate`), unmerged, stacked, each with its own scale.

An adapter is read and converted once (`lora_formats`), held in host memory (pinned for a CUDA pipeline) while it is
among the `max_cpu_loras` most recently used, and re-read from its file when needed again after eviction. `activate`
builds the GPU copies of the requested set (q/k/v of each attention in one `h3gen.lora.LoraGroup`, every other
module alone) and hooks them into the transformer's linears; the same set with the same scales is kept as it is,
so consecutive requests with one adapter set pay nothing, and a different set costs one host-to-device copy of its
factors. AdaLN projections are linears like the others, so their update lands in the per-request AdaLN tables
(`H3Transformer.precompute_adaln`) as well as in the exact tier's per-step projection.
"""

import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from h3gen.errors import RequestError
from h3gen.lora import AUTO_MERGE_MAX_ROUNDING_LOSS, LoraFactors, LoraGroup, merge_delta, merge_factors, rounding_loss
from h3gen.options import parse_bytes
from h3gen.pipelines.h3.lora_formats import LoraFile, load_lora_factors, read_lora

logger = logging.getLogger(__name__)

DEFAULT_MAX_CPU_LORAS = 4
LORA_GPU_RESERVE = 2 * 2**30  # device memory adapters leave to activations when no lora_gpu_memory is set


@dataclass
class Adapter:
    """A converted adapter in host memory: its `file` description and `factors[partition][module]`."""

    file: LoraFile
    factors: dict[str, dict[str, LoraFactors]]

    @property
    def name(self) -> str:
        return self.file.name

    def part_for(self, task: str) -> tuple[str, dict[str, LoraFactors]]:
        """(the partition `route_partition` picks for `task`, its factors)."""
        partition = route_partition(task, tuple(self.factors), self.name)
        return partition, self.factors[partition]


def route_partition(task: str, partitions, name: str) -> str:
    """Which of a file's `partitions` ("transformer", "transformer_ref") applies to `task`, routed as diffusers
    routes them: a ref2va request uses the file's `transformer_ref` layers when it has any, else its `transformer`
    layers (on the ref partition, as diffusers' loader does for a pipeline holding `transformer_ref` only); t2va and
    fl2va use its `transformer` layers. A file with `transformer_ref` layers only is a `RequestError` for them."""
    if task == "ref2va" and "transformer_ref" in partitions:
        return "transformer_ref"
    if "transformer" in partitions:
        return "transformer"
    raise RequestError(
        f"LoRA {name} holds transformer_ref (ref2va) layers only; use it with a ref2va request "
        f"(references), not {task}.",
        "loras",
    )


# The block linears whose input a tier's fused block forward writes into a K-extended LoRA's wide buffer
# (`pipelines/h3/tiers.py`): the lossless tier's q/k/v, SwiGLU projection and ff.net.2 (its attention output comes
# from the attention kernel, so to_out keeps the update written first); the fast tier's FP8 linears, to_out too.
_DENSE_EXTENDED = re.compile(r"transformer_blocks\.\d+\.(attn\.to_[qkv]|ff\.net\.0\.proj|ff\.net\.2)$")


def lora_device_bytes(lora: LoraFile, task: str, itemsize: int, fp8_modules=frozenset(), extended: bool = True) -> int:
    """The device bytes `activate` holds for the `task` part of `lora`, from its header alone, at `itemsize` bytes
    per element: every module's B (out_features x rank) and every distinct A (rank x in_features; the A a fused-QKV
    file shares between q, k and v is held once, as `LoraGroup` holds it). A group with a layer among
    `fp8_modules` (`fp8_layers`: the fast tier) also holds its A as e4m3 rows padded to 16 with a float32 scale
    each, made on its first forward with e4m3 input. With `extended` (a resident model, not tensor parallel: where
    `activate` lets groups run their updates inside their GEMMs, `h3gen.lora.wide`), each member of a group the
    blocks' fused forward feeds through `wide_input` also holds the extra columns of its extended weight: at most
    `out_features` x the group's projected rows (padded to 16, e4m3, in an FP8 group; to 8, at `itemsize`, in a
    dense one), counted in full (an upper bound: a member reads the projected columns on one side of its input
    only, up to its own, `LoraGroup._lay_out_wide`, and the `exact` tier extends nothing). Exact otherwise, on one
    device; a tensor-parallel rank holds its shard of each, less."""
    partition = route_partition(task, lora.partitions, lora.name)
    downs: dict[str, tuple[int, int, str]] = {}  # A's key -> (rank, in_features, the group it is projected in)
    elements, fp8_groups, outputs = 0, set(), {}
    for target in lora.targets:
        if target.partition == partition:
            group = _group_of(target.module)
            downs[target.down_key] = (target.rank, target.in_features, group)
            elements += target.out_features * target.rank
            outputs.setdefault(group, {})[target.module] = target.out_features
            if target.module in fp8_modules:
                fp8_groups.add(group)
    total = (elements + sum(rank * width for rank, width, _ in downs.values())) * itemsize
    for group, members in outputs.items():
        rows = sum(rank for rank, _, of in downs.values() if of == group)
        if group in fp8_groups:
            width = next(width for _, width, of in downs.values() if of == group)
            padded = rows + -rows % 16
            total += padded * width + padded * 4  # e4m3 values and a float32 scale per row
            if extended:
                total += padded * sum(members.values())  # the extended weights' e4m3 columns
        elif extended and all(_DENSE_EXTENDED.search(module) for module in members):
            total += (rows + -rows % 8) * sum(members.values()) * itemsize
    return total


def fp8_layers(model: nn.Module) -> set[str]:
    """The names of `model`'s linears that hold e4m3 weights (the fast tier's `Fp8Linear`s and FP8 TP shards)."""
    return {
        name
        for name, module in model.named_modules()
        if getattr(getattr(module, "weight", None), "dtype", None) == torch.float8_e4m3fn
    }


def check_targets(model: nn.Module, lora: LoraFile) -> None:
    """Refuse a file whose modules `model` (an `H3Transformer`) lacks or whose shapes do not fit it, naming the first
    such key / module and both shapes."""
    for target in lora.targets:
        try:
            layer = model.get_submodule(target.module)
        except AttributeError:
            layer = None
        if layer is None or not hasattr(layer, "in_features") or not hasattr(layer, "out_features"):
            raise RequestError(
                f"LoRA {lora.name}: key `{target.down_key}` names `{target.module}`, which is not a "
                "linear layer of the MiniMax-H3 transformer.",
                "loras",
            )
        want, have = (target.out_features, target.in_features), (layer.out_features, layer.in_features)
        if want != have:
            raise RequestError(
                f"LoRA {lora.name}: `{target.module}` updates a {want[0]} x {want[1]} weight, but the model's is "
                f"{have[0]} x {have[1]} (an adapter trained on another, e.g. pruned, checkpoint).",
                "loras",
            )


class LoraRegistry:
    """Adapters by name, the `max_cpu_loras` most recently used held converted in host memory.

    `check(lora_file)` validates a file against the model before its tensors are read (raising `RequestError`);
    `head_dim` is the model's attention head size; `pin` pins the host copies (for fast copies to a GPU)."""

    def __init__(
        self, max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS, *, head_dim: int = 128, check=None, pin: bool = False
    ):
        if not isinstance(max_cpu_loras, int) or max_cpu_loras < 1:
            raise RequestError(f"max_cpu_loras must be an integer >= 1 (got {max_cpu_loras!r}).", "max_cpu_loras")
        self.max_cpu_loras, self.head_dim, self.check, self.pin = max_cpu_loras, head_dim, check, pin
        self._sources: dict[str, tuple[Path, float | None]] = {}  # every registered name -> (file, alpha)
        self._cache: OrderedDict[str, Adapter] = OrderedDict()

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    @property
    def cached(self) -> list[str]:
        """Names held in host memory, least recently used first."""
        return list(self._cache)

    def register(self, path, name: str | None = None, alpha: float | None = None) -> str:
        """Read, check and convert the file at `path` under `name` (default: the file's stem); `alpha` replaces the
        file's alpha (uniform network alpha). A name registered before is re-pointed. Returns the name."""
        path = Path(path)
        name = name or path.stem
        if alpha is not None and (not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0):
            raise RequestError(f"LoRA {name}: alpha must be a finite number > 0 (got {alpha!r}).", "alpha")
        self._cache.pop(name, None)
        self._sources[name] = (path, None if alpha is None else float(alpha))
        try:
            self.adapter(name)
        except RequestError:
            del self._sources[name]
            raise
        return name

    def adapter(self, name: str) -> Adapter:
        """The converted adapter `name` (read again from its file if it was evicted); marks it most recently used."""
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        if name not in self._sources:
            raise RequestError(
                f"no LoRA named {name!r} is loaded (known: {', '.join(self._sources) or 'none'}).", "loras"
            )
        path, alpha = self._sources[name]
        lora = read_lora(path, head_dim=self.head_dim, alpha=alpha, name=name)
        if self.check is not None:
            self.check(lora)
        factors = load_lora_factors(lora, head_dim=self.head_dim)
        if self.pin:
            pinned = {}  # by identity: an A the fused QKV's three modules share stays one tensor

            def pin(tensor):
                if id(tensor) not in pinned:
                    pinned[id(tensor)] = (tensor, tensor.pin_memory())
                return pinned[id(tensor)][1]

            for part in factors.values():
                for module, f in part.items():
                    part[module] = LoraFactors(pin(f.down), pin(f.up), f.scale)
        adapter = Adapter(lora, factors)
        self._cache[name] = adapter
        while len(self._cache) > self.max_cpu_loras:
            evicted, _ = self._cache.popitem(last=False)
            logger.info("LoRA %s leaves host memory (max_cpu_loras=%d).", evicted, self.max_cpu_loras)
        return adapter

    def resolve(self, loras) -> list[tuple[Adapter, float]]:
        """A request's `loras` (`[name_or_path, (name_or_path, scale), ...]`) -> `[(adapter, scale), ...]`. A path
        not registered yet is registered under its stem."""
        if loras is None:
            return []
        if isinstance(loras, (str, Path)) or not isinstance(loras, (list, tuple)):
            raise RequestError("loras must be a list of names or paths, or (name or path, scale) pairs.", "loras")
        out, seen = [], set()
        for item in loras:
            scale = 1.0
            if isinstance(item, (list, tuple)):
                if len(item) != 2:
                    raise RequestError(
                        f"each LoRA is a name or path, or a (name or path, scale) pair (got {item!r}).", "loras"
                    )
                item, scale = item
            if not isinstance(item, (str, Path)):
                raise RequestError(f"a LoRA is named by a string or a path (got {type(item).__name__}).", "loras")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise RequestError(f"LoRA scale must be a finite number (got {scale!r}).", "loras")
            name = str(item)
            if name not in self._sources:
                path = Path(name)
                if not path.is_file():
                    raise RequestError(f"no LoRA named {path.name!r} is loaded and no such file exists.", "loras")
                name = self._known_path(path) or self.register(path, self._free_name(path.stem))
            if name in seen:
                raise RequestError(f"LoRA {name} is listed twice; give it once with the sum of its scales.", "loras")
            seen.add(name)
            out.append((self.adapter(name), float(scale)))
        return out

    def _free_name(self, stem: str) -> str:
        """`stem`, or `stem-2`, `stem-3`, ... when another file holds that name."""
        name, index = stem, 1
        while name in self._sources:
            index += 1
            name = f"{stem}-{index}"
        return name

    def _known_path(self, path: Path) -> str | None:
        for name, (source, alpha) in self._sources.items():
            if alpha is None and source.resolve() == path.resolve():
                return name
        return None


# ---------------------------------------------------------------------- applying a set to a transformer

_QKV = re.compile(r"^(.*\.attn)\.to_[qkv]$")


def _group_of(module: str) -> str:
    """The `LoraGroup` a module's adapters join: one per attention's q, k and v, else the module alone."""
    match = _QKV.match(module)
    return match.group(1) + ".qkv" if match else module


@dataclass
class ActiveLoras:
    """The adapter set a transformer currently applies: `key` identifies it (adapters and scales), `groups` hold the
    device copies."""

    key: tuple
    groups: list[LoraGroup]
    layers: dict[str, nn.Module]  # module name -> the layer hooked (a layer replaced since, e.g. by FP8, voids the set)

    def current(self, transformer, key: tuple) -> bool:
        """Whether this set is `key` and still hooked into `transformer`'s present layers."""
        return self.key == key and all(transformer.get_submodule(name) is layer for name, layer in self.layers.items())

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def active_loras(transformer) -> ActiveLoras | None:
    return getattr(transformer, "active_loras", None)


def deactivate(transformer) -> None:
    """Unhook every adapter from `transformer` and free their device copies."""
    active = active_loras(transformer)
    if active is not None:
        for group in active.groups:
            group.detach()
    transformer.active_loras = None


def activate(
    transformer, adapters: list[tuple[Adapter, float]], task: str, device, inside_gemm: bool = True
) -> ActiveLoras | None:
    """Make `transformer` apply exactly `adapters` (`[(adapter, scale), ...]`, their `task` parts) from its next
    forward on; an empty list removes every adapter. The same set as now is left as it is. `inside_gemm=False` keeps
    the updates out of the GEMMs (`h3gen.lora.wide`): written before the lossless tier's, added after the fast
    tier's FP8 ones (benchmarks compare both)."""
    key = tuple((id(adapter), adapter.name, scale) for adapter, scale in adapters) + (inside_gemm,)
    active = active_loras(transformer)
    if active is not None and active.current(transformer, key):
        return active
    deactivate(transformer)
    if not adapters:
        return None
    per_module: dict[str, list[LoraFactors]] = {}
    for adapter, scale in adapters:
        _, part = adapter.part_for(task)
        for module, f in part.items():
            per_module.setdefault(module, []).append(LoraFactors(f.down, f.up, f.scale * scale))
    grouped: dict[str, list[tuple[nn.Module, list[LoraFactors]]]] = {}
    layers = {module: transformer.get_submodule(module) for module in per_module}
    for module, factors in per_module.items():
        grouped.setdefault(_group_of(module), []).append((layers[module], factors))
    groups = []
    # K-extended weights need the layers to stay where they are: not under layer-wise offload.
    wide = inside_gemm and getattr(transformer, "offload", None) is None
    try:
        for members in grouped.values():
            groups.append(LoraGroup.build(members, device, wide=wide).attach())
    except BaseException:
        for group in groups:
            group.detach()
        raise
    transformer.active_loras = ActiveLoras(key, groups, layers)
    return transformer.active_loras


def lora_budget_bytes(value) -> int | None:
    """A `lora_gpu_memory` setting ("4GiB", "512MiB", bytes or None) in bytes."""
    try:
        budget = parse_bytes(value)
    except RequestError:
        raise RequestError(
            f"lora_gpu_memory must look like 4GiB, 2GB or 512MiB (got {value!r}).", "lora_gpu_memory"
        ) from None
    if budget is not None and budget < 0:
        raise RequestError(f"lora_gpu_memory must be 0 bytes or more (got {value!r}).", "lora_gpu_memory")
    return budget


def check_device_budget(need: int, names: list[str], limit: int | None, available: int | None) -> None:
    """Refuse (`RequestError`, field "loras") a request whose adapters `names` need `need` bytes on the device
    (`lora_device_bytes`) when that exceeds `limit` bytes (`lora_gpu_memory`), or without a limit, `available` (the
    device memory they may take, including what the adapters active now hold; None: no cap, as on the CPU) less
    `LORA_GPU_RESERVE`."""
    if limit is not None:
        budget, what = limit, "lora_gpu_memory"
    elif available is not None:
        budget, what = max(0, available - LORA_GPU_RESERVE), "free device memory less 2 GiB"
    else:
        return
    if need > budget:
        raise RequestError(
            f"the {len(names)} LoRA adapters ({', '.join(names)}) need {_size(need)} on the device, "
            f"more than the {_size(budget)} they may use ({what}); use fewer.",
            "loras",
        )


def _size(nbytes: int) -> str:
    """Bytes for a message: "1.50 GiB", "12.3 MiB", "640 KiB"."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def merge_into(model: nn.Module, name: str, factors: dict[str, LoraFactors], scale: float) -> None:
    """Add an adapter's update into `model`'s dense weights for good, refused (`RequestError`, nothing changed) when
    rounding to the weights' dtype would lose more than `AUTO_MERGE_MAX_ROUNDING_LOSS` of the update on any module
    (measured per module by norm, as SGLang's `auto` merge mode does) or when a base layer is not dense."""

    def delta(module: str, f: LoraFactors):
        layer = model.get_submodule(module)
        try:
            return layer, merge_delta(layer, [LoraFactors(f.down, f.up, f.scale * scale)])
        except ValueError as error:
            raise RequestError(f"LoRA {name} cannot be merged into `{module}`: {error}", "merge") from None

    # Measured for every module first, each update dropped after (a full-size model's would not fit at once).
    for module, f in factors.items():
        layer, update = delta(module, f)
        loss = rounding_loss(layer.weight, update)
        if loss > AUTO_MERGE_MAX_ROUNDING_LOSS:
            raise RequestError(
                f"LoRA {name} cannot be merged: rounding to {layer.weight.dtype} would lose {loss:.0%} of its update "
                f"on `{module}` (more than {AUTO_MERGE_MAX_ROUNDING_LOSS:.0%}); load it without merge=True to apply "
                "it unmerged.",
                "merge",
            )
    for module, f in factors.items():
        merge_factors(*delta(module, f))
