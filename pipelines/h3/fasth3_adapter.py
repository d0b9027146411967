"""FastH3 adapters: FastVideo's `fastvideo-lora-v2` files, which turn base MiniMax-H3 into a FastH3 student when merged
into its weights at load.

A file (safetensors metadata `format` "fastvideo-lora-v2", `base_model` "MiniMaxAI/MiniMax-H3", `finetuned_model`
naming the student, `rank`, `low_rank_tensors`, `diff_tensors`, `set_weight_tensors`) holds, in diffusers' module
names (optionally under `transformer.` or `diffusion_model.`):
  - `<module>.lora_A.weight` [rank, in] / `<module>.lora_B.weight` [out, rank] on every block's `attn.to_q/to_k/to_v/
    to_out.0`, `ff.net.0.proj`, `ff.net.2`, `adaln_proj.linear` and the refiner blocks' layers, applied with scale 1
    (no alpha): W = W + B A;
  - `<module>.diff` (a full weight delta) and `<module>.diff_b` (a bias delta), added: the norms, the embedders, the
    output heads, `time_embedder.linear_1/2`, `norm_out.linear/norm`, every `adaln_proj.linear.bias`; tensors
    training left unchanged are omitted;
  - `transformer_blocks.{i}.attn.to_gate_compress.set_weight`, a VSA student's attention gate in every block,
    assigned (the dense student has none).
The SwiGLU `ff.net.0.proj` delta is `[value; gate]`, the order of our fused weight (`SwiGLUIn`), so it adds as it
comes. (vLLM-Omni `fasth3.py`, `_MODEL_LEVEL_TARGETS` / `_BLOCK_TARGETS`; tenstorrent tt-metal's MiniMax-H3 LoRA test
counts 724 factors, 27 / 24 `.diff`, 58 `.diff_b` and 0 / 50 gates in the dense / VSA files.)

The merge runs on the tensors as the loader streams them (`merge_stream`), before tensor-parallel slicing, MXFP4
quantization and layer-wise offload staging: each changed weight is computed in float32 (base + B A + diff) and cast
once to the checkpoint tensor's dtype, which is what a full student checkpoint made from the same deltas holds. A
tensor-parallel rank computes only its slice of each update (B's rows for a column shard, A's columns for a row
shard). The merged model is then the student: its sampling contract follows the file (`FastH3Adapter.contract`).
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from h3gen.errors import CheckpointError, RequestError
from h3gen.pipelines.h3.fasth3 import DMD_STEPS, VSA_SPARSITY, StudentContract, student_recipe

ADAPTER_FORMAT = "fastvideo-lora-v2"
BASE_MODEL = "MiniMaxAI/MiniMax-H3"
KEY_PREFIXES = ("transformer.", "model.diffusion_model.", "diffusion_model.")
MODEL_TARGETS = (
    "proj_in",
    "proj_out",
    "audio_proj_in",
    "audio_proj_out",
    "context_embedder",
    "time_embedder.linear_1",
    "time_embedder.linear_2",
    "norm_out.linear",
    "norm_out.norm",
)
BLOCK_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
    "adaln_proj.linear",
    "norm1",
    "norm2",
)
BLOCK_STACKS = ("transformer_blocks", "token_refiner.refiner_blocks")
GATE_MODULE = "attn.to_gate_compress"
_BLOCK = re.compile(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)")
# Key suffix -> (kind, the leaf of the parameter it changes).
_KINDS = (
    (".lora_A.weight", "A", "weight"),
    (".lora_B.weight", "B", "weight"),
    (".diff_b", "diff", "bias"),
    (".diff", "diff", "weight"),
    (".set_weight", "set", "weight"),
)
# The original release's names (fused `qkv_proj`, `mlp.fc1` in [gate; value] order): not this format's.
_NATIVE = re.compile(r"(^|\.)(blocks\.\d+\.|final_layer\.)|\.qkv_proj$|\.mlp\.fc[12]$")


def _bad(name: str, message: str) -> CheckpointError:
    return CheckpointError(f"FastH3 adapter {name}: {message}")


def is_fasth3_adapter(path) -> bool:
    """True when the safetensors file at `path` says it is a `fastvideo-lora-v2` file (its metadata `format`)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("format") == ADAPTER_FORMAT
    except Exception:  # not a safetensors file: the regular LoRA reader reports it
        return False


@dataclass(frozen=True)
class Patch:
    """What the adapter does to one model tensor (`target`, e.g. "transformer_blocks.3.attn.to_q.weight"): the file
    keys of its low-rank factors (`lora_a`, `lora_b`), of its full delta (`diff`), or of the tensor it assigns
    (`assign`)."""

    target: str
    lora_a: str | None = None
    lora_b: str | None = None
    diff: str | None = None
    assign: str | None = None


@dataclass(frozen=True)
class FastH3Adapter:
    """A `fastvideo-lora-v2` file read from its header (`read_fasth3_adapter`): its `patches` by target tensor, the
    `shapes` of its tensors by file key, its `metadata`."""

    path: Path
    name: str
    metadata: dict[str, str]
    patches: dict[str, Patch]
    shapes: dict[str, tuple[int, ...]]

    @property
    def gated(self) -> bool:
        """True for a VSA student's adapter (it assigns `to_gate_compress` in every block)."""
        return any(patch.assign is not None for patch in self.patches.values())

    @property
    def gates(self) -> list[str]:
        return sorted(target for target, patch in self.patches.items() if patch.assign is not None)

    @property
    def finetuned_model(self) -> str:
        return self.metadata.get("finetuned_model", "")

    @property
    def is_student(self) -> bool:
        """True when the file states it makes a FastH3 student (`finetuned_model` in FastVideo's namespace, naming
        FastH3), or when it creates the VSA gates (a gated model only runs as a VSA student)."""
        identity = self.finetuned_model.lower()
        return self.gated or (identity.startswith("fastvideo/") and "fasth3" in identity)

    def contract(self, video_shift: float, audio_shift: float) -> StudentContract | None:
        """The sampling contract of the merged model: FastH3's 4 forwards on the DMD positions, VSA-H3 at 0.9 when
        the file creates gates, dense attention otherwise; None when the file is not a FastH3 student's."""
        if not self.is_student:
            return None
        recipe = student_recipe(DMD_STEPS, video_shift, audio_shift, self.gated)
        return StudentContract(recipe, VSA_SPARSITY if self.gated else None)

    def describe(self) -> dict:
        """A JSON-able summary (no path)."""
        counts = {"low_rank": 0, "diff": 0, "set_weight": 0}
        for patch in self.patches.values():
            counts["low_rank"] += 2 * (patch.lora_a is not None)
            counts["diff"] += patch.diff is not None
            counts["set_weight"] += patch.assign is not None
        return {"name": self.name, "format": ADAPTER_FORMAT, "finetuned_model": self.finetuned_model} | counts

    def check(self, shapes: dict[str, tuple[int, ...]], num_layers: int, num_refiner_layers: int) -> None:
        """Check the file against a model's full (unsharded) tensor shapes, `shapes` (the model built with gates when
        the file creates them). Raises `CheckpointError` naming the first offending key: a target the model lacks, a
        shape that does not fit, a rank that differs between A and B, a block the file leaves untouched, gates in
        some blocks only."""
        for target, patch in sorted(self.patches.items()):
            key = patch.assign or patch.diff or patch.lora_a or patch.lora_b
            if target not in shapes:
                raise _bad(self.name, f"`{key}` updates `{target}`, which the model does not have.")
            want = tuple(shapes[target])
            if patch.assign is not None:
                self._fits(patch.assign, want, want)
                continue
            if patch.diff is not None:
                self._fits(patch.diff, self.shapes[patch.diff], want)
            if patch.lora_a is not None:
                a, b = self.shapes[patch.lora_a], self.shapes[patch.lora_b]
                if len(want) != 2 or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                    raise _bad(
                        self.name,
                        f"`{patch.lora_a}` {list(a)} and `{patch.lora_b}` {list(b)} are not a low-rank pair for a "
                        f"{' x '.join(map(str, want))} weight.",
                    )
                self._fits(patch.lora_b, (b[0], a[1]), want)
        touched: dict[str, set[int]] = {stack: set() for stack in BLOCK_STACKS}
        for target, patch in self.patches.items():
            found = _BLOCK.fullmatch(target)
            if found and patch.lora_a is not None:
                touched[found.group(1)].add(int(found.group(2)))
        for stack, count in zip(BLOCK_STACKS, (num_layers, num_refiner_layers), strict=True):
            missing = sorted(set(range(count)) - touched[stack])
            if missing:
                raise _bad(
                    self.name,
                    f"it leaves {stack}.{missing[0]} without low-rank updates ({len(missing)} of the model's {count} "
                    f"{stack} untouched): it was not made for this checkpoint.",
                )
        gates = self.gates
        if gates and len(gates) != num_layers:
            have = {int(_BLOCK.fullmatch(target).group(2)) for target in gates}
            first = min(set(range(num_layers)) - have)
            raise _bad(
                self.name,
                f"it sets the VSA gate of {len(gates)} of the model's {num_layers} blocks; "
                f"`transformer_blocks.{first}.attn.to_gate_compress.set_weight` is missing (a VSA student has one in "
                "every block).",
            )

    def _fits(self, key: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(want):
            got = self.shapes[key]
            raise _bad(
                self.name,
                f"`{key}` {list(got)} makes a {' x '.join(map(str, shape))} update, but the model's tensor is "
                f"{' x '.join(map(str, want))}.",
            )


def _target(name: str, key: str) -> tuple[str, str]:
    """(target tensor, kind) of one file key, or `CheckpointError`."""
    bare = key
    for prefix in KEY_PREFIXES:
        if bare.startswith(prefix):
            bare = bare[len(prefix) :]
            break
    matched = [(suffix, kind, leaf) for suffix, kind, leaf in _KINDS if bare.endswith(suffix)]
    if not matched:
        raise _bad(name, f"key `{key}` is none of lora_A / lora_B / diff / diff_b / set_weight.")
    suffix, kind, leaf = matched[0]
    module = bare[: -len(suffix)]
    if bare.startswith("transformer_ref."):
        raise _bad(name, f"key `{key}` updates transformer_ref/; FastH3 students are t2va models of transformer/.")
    found = _BLOCK.fullmatch(module)
    if kind == "set":
        if found is None or found.group(1) != "transformer_blocks" or found.group(3) != GATE_MODULE:
            raise _bad(
                name,
                f"key `{key}` assigns `{module}`; a set_weight may only create a transformer block's VSA gate "
                "(`transformer_blocks.{i}.attn.to_gate_compress`).",
            )
        return f"{module}.{leaf}", kind
    if (found is not None and found.group(3) in BLOCK_TARGETS) or module in MODEL_TARGETS:
        return f"{module}.{leaf}", kind
    if _NATIVE.search(module):
        raise _bad(
            name,
            f"key `{key}` names the original release's module `{module}` (fused qkv_proj / mlp.fc1); "
            "fastvideo-lora-v2 files use diffusers' names, and this loader places no delta into a fused weight.",
        )
    raise _bad(name, f"key `{key}` updates `{module}`, which is not a module FastH3 adapters change.")


def read_fasth3_adapter(path, name: str | None = None) -> FastH3Adapter:
    """Read a `fastvideo-lora-v2` file's header (keys, shapes, metadata; no tensor data). Raises `CheckpointError`
    naming the file by its name only: not this format, a key of another kind or module, a factor without its pair,
    two deltas for one tensor, a count its metadata contradicts."""
    path = Path(path)
    name = name or path.stem
    if not path.is_file():
        raise _bad(name, "no such file.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for a file that is not one
        raise _bad(name, f"not a readable safetensors file ({type(error).__name__}).") from None
    if metadata.get("format") != ADAPTER_FORMAT:
        raise _bad(name, f"its metadata format is {metadata.get('format')!r}, not {ADAPTER_FORMAT!r}.")
    base = metadata.get("base_model")
    if base is not None and base.casefold() != BASE_MODEL.casefold():
        raise _bad(name, f"it was made for {base!r}, not {BASE_MODEL}.")
    parts: dict[str, dict[str, str]] = {}
    for key in sorted(shapes):
        target, kind = _target(name, key)
        entry = parts.setdefault(target, {})
        if kind in entry or (kind in ("diff", "set") and {"diff", "set"} & set(entry)):
            raise _bad(name, f"`{key}` is a second delta for `{target}`.")
        entry[kind] = key
    patches = {}
    for target, entry in parts.items():
        if ("A" in entry) != ("B" in entry):
            given = entry.get("A") or entry.get("B")
            raise _bad(name, f"`{given}` has no {'lora_B' if 'A' in entry else 'lora_A'} beside it.")
        if "set" in entry and len(entry) > 1:
            raise _bad(name, f"`{entry['set']}` assigns `{target}`, which the file also updates.")
        patches[target] = Patch(target, entry.get("A"), entry.get("B"), entry.get("diff"), entry.get("set"))
    adapter = FastH3Adapter(path, name, metadata, patches, shapes)
    counts = adapter.describe()
    for field, counted in (("low_rank_tensors", counts["low_rank"]), ("set_weight_tensors", counts["set_weight"])):
        stated = metadata.get(field)
        if stated is not None and stated.strip().isdigit() and int(stated) != counted:
            raise _bad(name, f"its metadata states {field}={stated} but it holds {counted}: the file is incomplete.")
    rank = metadata.get("rank")
    if rank is not None and rank.strip().isdigit():
        for patch in patches.values():
            if patch.lora_a is not None and shapes[patch.lora_a][0] != int(rank):
                raise _bad(name, f"`{patch.lora_a}` has rank {shapes[patch.lora_a][0]}; its metadata states {rank}.")
    if not patches:
        raise _bad(name, "the file holds no tensors.")
    return adapter


def _index(key, shape: tuple[int, ...]) -> tuple[slice, slice | None]:
    """The (rows, columns) a loader's `tensor[key]` reads: `[a:b]`, `[:]` or `[:, a:b]`."""
    if not isinstance(key, tuple):
        key = (key,)
    if len(key) > len(shape) or not all(isinstance(part, slice) and part.step in (None, 1) for part in key):
        raise TypeError("a merged checkpoint tensor can only be read by row or column ranges")
    rows = slice(*key[0].indices(shape[0]))
    cols = slice(*key[1].indices(shape[1])) if len(key) > 1 else (slice(0, shape[1]) if len(shape) > 1 else None)
    return rows, cols


class MergedTensor:
    """A checkpoint tensor with the adapter's update added, read lazily: a tensor-parallel module asks it for its
    rows (`[a:b]`) or columns (`[:, a:b]`), and only that part of the base and of the update is computed."""

    def __init__(self, base, patch: Patch, handle):
        self.base, self.patch, self.handle = base, patch, handle
        self.shape = tuple(base.shape) if isinstance(base, torch.Tensor) else tuple(base.get_shape())

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = _index(key, self.shape)
        part = self.base[key]
        return merge_tensor(part, self.patch, self.handle, rows, cols)


def merge_tensor(part: torch.Tensor, patch: Patch, handle, rows: slice, cols: slice | None) -> torch.Tensor:
    """`part` (rows `rows`, columns `cols` of the base tensor) + B[rows] A[:, cols] + diff[rows, cols], in float32,
    cast to `part`'s dtype."""
    merged = part.to(torch.float32)
    if patch.lora_a is not None:
        lora_a = handle.get_slice(patch.lora_a)[:, cols.start : cols.stop].to(torch.float32)
        lora_b = handle.get_slice(patch.lora_b)[rows.start : rows.stop].to(torch.float32)
        merged = merged + lora_b @ lora_a
    if patch.diff is not None:
        diff = handle.get_slice(patch.diff)
        diff = diff[rows.start : rows.stop] if cols is None else diff[rows.start : rows.stop, cols.start : cols.stop]
        merged = merged + diff.to(torch.float32)
    return merged.to(part.dtype)


def merge_stream(
    adapter: FastH3Adapter, tensors: Iterable[tuple[str, str, object]], *, lazy: bool = False
) -> Iterator[tuple[str, str, object]]:
    """The loader's `(source key, target key, tensor)` stream with `adapter` merged: each tensor it updates comes
    out merged (a `MergedTensor` for a lazy slice, so a tensor-parallel rank computes only its shard), then the
    tensors it assigns (the gates; lazy slices with `lazy`). Raises `CheckpointError` if the checkpoint holds a
    tensor the file assigns (already a student), or lacks one it updates."""
    seen = set()
    with safe_open(str(adapter.path), framework="pt") as handle:
        for source_key, target_key, tensor in tensors:
            patch = adapter.patches.get(target_key)
            if patch is None:
                yield source_key, target_key, tensor
                continue
            if patch.assign is not None:
                raise _bad(
                    adapter.name,
                    f"the checkpoint already holds `{target_key}`: it is a FastH3 student, not the base model the "
                    "adapter is made for.",
                )
            seen.add(target_key)
            if isinstance(tensor, torch.Tensor):
                rows, cols = _index(slice(None), tuple(tensor.shape))
                tensor = merge_tensor(tensor, patch, handle, rows, cols)
            else:
                tensor = MergedTensor(tensor, patch, handle)
            yield source_key, target_key, tensor
        for target, patch in sorted(adapter.patches.items()):
            if patch.assign is not None:
                value = handle.get_slice(patch.assign) if lazy else handle.get_tensor(patch.assign)
                yield patch.assign, target, value
            elif target not in seen:
                key = patch.diff or patch.lora_a
                raise _bad(adapter.name, f"`{key}` updates `{target}`, which the checkpoint does not hold.")


def split_load_time_loras(loras) -> tuple[FastH3Adapter | None, list[tuple[str, float]]]:
    """`H3Pipeline.from_pretrained`'s `loras` (`[path or (path, scale), ...]`): the FastH3 adapter among them (read
    from its header, or None) and the others as `(path, scale)`."""
    adapter, others = None, []
    for entry in loras or []:
        path, scale = (entry, 1.0) if not isinstance(entry, (tuple, list)) else entry
        if not is_fasth3_adapter(path):
            others.append((path, scale))
            continue
        read = read_fasth3_adapter(path)
        if adapter is not None:
            raise RequestError(
                f"loras names two FastH3 adapters ({adapter.name}, {read.name}); a model merges one student.", "loras"
            )
        if scale != 1.0:
            raise RequestError(
                f"FastH3 adapter {read.name} merges at scale 1 (got {scale}): a student is not a strength.", "loras"
            )
        adapter = read
    return adapter, others


def merge_cost(adapter: FastH3Adapter) -> dict:
    """Work the merge does (from the header): multiply-adds of the B A products, and elements of the updated and
    created tensors (each read and written once)."""
    flops = elements = 0
    for patch in adapter.patches.values():
        if patch.lora_a is not None:
            rank, inner = adapter.shapes[patch.lora_a]
            out = adapter.shapes[patch.lora_b][0]
            flops += 2 * out * rank * inner
            elements += out * inner
        elif patch.diff is not None or patch.assign is not None:
            elements += math.prod(adapter.shapes[patch.diff or patch.assign])
    return {"flops": flops, "elements": elements}


def refuse_per_request(name: str) -> RequestError:
    """The error a per-request use of a FastH3 adapter gets."""
    return RequestError(
        f"LoRA {name} is a FastH3 adapter ({ADAPTER_FORMAT}): it changes the model for good (full-rank deltas, new "
        "attention gates, its own sampling contract), so it is merged when the model loads, not per request; load "
        "it with H3Pipeline.from_pretrained(model, loras=[path]) (the CLI and server: --merge-lora PATH).",
        "loras",
    )
