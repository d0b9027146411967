"""Streamed safetensors loading into a model built on the meta device (any model: each model's own loader, e.g.
`pipelines/h3/loader.py`, builds it and names the tensors).

The model's parameters are created on the meta device (no memory), then every tensor is read from its file, cast
straight from the file dtype to its target dtype (float32 for the islands, the requested dtype elsewhere) and moved
to the target device, one tensor at a time: a full-precision copy of the model never exists.
"""

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from h3gen.errors import CheckpointError
from h3gen.loading.files import safetensors_files

_MAX_LISTED = 12


@contextmanager
def meta_parameters():
    """Create tensors on the meta device inside this block: no memory is allocated and no initialisation runs.

    Buffers that are computed rather than loaded (RoPE frequencies) must be created with an explicit `device=`.
    """
    with torch.device("meta"):
        yield


def keeps_fp32(name: str, keep_fp32_modules: Iterable[str]) -> bool:
    """True if a dotted parameter name has a component in `keep_fp32_modules` (diffusers' rule at load time)."""
    parts = name.split(".")
    return any(module in parts for module in keep_fp32_modules)


def read_tensors(folder: Path, lazy: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield `(key, cpu tensor)` for every tensor of a component folder, one at a time; with `lazy`, a safetensors
    slice instead, from which a tensor-parallel module reads only its shard (`slice[a:b]`, `slice[:, a:b]`)."""
    for path, keys in safetensors_files(folder).items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in keys if keys is not None else handle.keys():
                    yield key, handle.get_slice(key) if lazy else handle.get_tensor(key)
        except (OSError, ValueError, RuntimeError) as error:  # safetensors raises SafetensorError (a subclass)
            if isinstance(error, CheckpointError):
                raise
            raise CheckpointError(f"Cannot read {path}: {error}") from None


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def assign_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    keep_fp32_modules: Iterable[str] = (),
    source: str = "checkpoint",
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Fill a meta-initialised model from `(source key, target key, tensor)` triples.

    Floating tensors become `dtype` (float32 for names matching `keep_fp32_modules`); other dtypes (packed
    quantized weights, integer buffers) are kept. Target keys for which `skip` is true are neither read nor
    reported missing: they stay on the meta device (their values come from elsewhere, e.g. a shared host store).
    Raises `CheckpointError` listing missing keys, unexpected keys and shape mismatches together.
    """
    keep_fp32_modules = tuple(keep_fp32_modules)
    slots = dict(model.named_parameters()) | dict(model.named_buffers())
    unexpected, mismatched, loaded = [], [], set()
    for source_key, target_key, tensor in tensors:
        if skip is not None and skip(target_key):
            loaded.add(target_key)
            continue
        owner_name, _, owner_leaf = target_key.rpartition(".")
        try:
            owner = model.get_submodule(owner_name) if owner_name and target_key not in slots else None
        except AttributeError:  # not a module of this model: reported as unexpected below
            owner = None
        if owner is not None and hasattr(owner, "load_checkpoint_tensor"):  # e.g. quantized on the fly (MXFP4)
            if not isinstance(tensor, torch.Tensor) and not getattr(owner, "takes_lazy_slices", False):
                tensor = tensor[:]
            if owner.load_checkpoint_tensor(owner_leaf, tensor, device, dtype):
                loaded.add(target_key)
                continue
        slot = slots.get(target_key)
        if slot is None:
            unexpected.append(source_key if source_key == target_key else f"{source_key} (as {target_key})")
            continue
        module_name, _, leaf = target_key.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "load_shard"):  # tensor parallel: keep (and, from a lazy slice, read) this rank's part
            tensor = module.load_shard(leaf, tensor)
        if not isinstance(tensor, torch.Tensor):  # a lazy slice that no module cut: read it whole
            tensor = tensor[:]
        if tuple(slot.shape) != tuple(tensor.shape):
            mismatched.append(f"{target_key}: checkpoint {tuple(tensor.shape)}, model {tuple(slot.shape)}")
            continue
        target_dtype = tensor.dtype
        if tensor.is_floating_point():
            target_dtype = torch.float32 if keeps_fp32(target_key, keep_fp32_modules) else dtype
        value = tensor.to(device=device, dtype=target_dtype)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[leaf] = value
        loaded.add(target_key)
    missing = [name for name, param in model.named_parameters() if name not in loaded]
    missing += [
        name
        for name, buffer in model.named_buffers()
        if buffer.device.type == "meta"
        and name not in loaded
        and not any(f"{name.rpartition('.')[0]}.weight" == key for key in loaded)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {_listing(mismatched)}")
    if problems:
        raise CheckpointError(f"{source} does not match the model; " + "; ".join(problems) + ".")
