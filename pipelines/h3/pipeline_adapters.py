"""A pipeline's LoRA adapters: the registry of loaded files, the adapters merged into each partition, the few-step
recipes they bring, and the device-memory budget a request's adapters are checked against before any model work."""

import math
from typing import Callable

import torch

from h3gen.errors import RequestError
from h3gen.pipelines.h3.adapter_memory import DeviceMemory
from h3gen.pipelines.h3.lora_registry import (
    DEFAULT_MAX_CPU_LORAS,
    LoraRegistry,
    active_loras,
    check_device_budget,
    check_targets,
    fp8_layers,
    lora_budget_bytes,
    lora_device_bytes,
    merge_into,
)
from h3gen.pipelines.h3.recipes import Recipe, recipe_for

PARTITIONS = ("transformer", "transformer_ref")


def partition_for(task: str) -> str:
    """The transformer partition that serves `task`: `transformer_ref` for ref2va, else `transformer`."""
    return "transformer_ref" if task == "ref2va" else "transformer"


class PipelineAdapters:
    """The adapters of one pipeline's transformer partitions (`models`: partition name -> loaded model).

    `max_cpu_loras` files stay converted in host memory (an LRU); `gpu_memory` ("4GiB", bytes or None) caps the
    device memory a request's adapters may take (None: what the device has free, less a margin)."""

    def __init__(
        self,
        models: dict,
        device: torch.device,
        *,
        transformer_for: Callable[[str], object],
        max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS,
        gpu_memory=None,
    ):
        self.models = {name: model for name, model in models.items() if model is not None}
        self.transformer_for = transformer_for
        first = next(iter(self.models.values()))
        self.registry = LoraRegistry(
            max_cpu_loras,
            head_dim=first.config.attention_head_dim,
            check=lambda lora: check_targets(first, lora),
            pin=device.type == "cuda",
        )
        self.gpu_memory = lora_budget_bytes(gpu_memory)
        self.device_memory = DeviceMemory(
            device,
            held=lambda: {
                name: active.nbytes
                for name, model in self.models.items()
                if (active := active_loras(model)) is not None
            },
        )
        self.merged: dict[str, list[tuple[str, float]]] = {}  # partition -> adapters merged into it

    def load(self, path, name: str | None = None, alpha: float | None = None, *, merge: bool = False, scale=1.0):
        """Register a file (see `H3Pipeline.load_lora`) and, with `merge`, add `scale` times its update into the
        dense weights of the partitions it holds layers for. Returns the name."""
        if merge and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
            raise RequestError(f"LoRA merge scale must be a finite number (got {scale!r}).", "merge")
        name = self.registry.register(path, name, alpha)
        if merge:
            adapter = self.registry.adapter(name)
            for partition, factors in adapter.factors.items():
                target = partition if partition == "transformer_ref" else next(iter(self.models))
                model = self.models.get(target)
                if model is None:
                    raise RequestError(
                        f"LoRA {name} holds {partition} layers, which this pipeline did not load.", "merge"
                    )
                merge_into(model, name, factors, scale)
                self.merged.setdefault(target, []).append((name, float(scale)))
        return name

    def resolve(self, loras) -> list:
        """A request's `loras` as `[(Adapter, scale)]` (`LoraRegistry.resolve`: a path not loaded yet is loaded)."""
        return self.registry.resolve(loras)

    def recipes(self, adapters: list, task: str) -> list[Recipe]:
        """The few-step recipes of a request's `adapters` (`[(Adapter, scale)]`) and of those merged into the
        partition `task` runs on, which its step count, shifts and task must agree with."""
        files = [adapter.file for adapter, _ in adapters]
        files += [self.registry.adapter(name).file for name, _ in self.merged.get(partition_for(task), [])]
        return [recipe for recipe in (recipe_for(lora.path.name, lora.metadata) for lora in files) if recipe]

    def check_budget(self, files: list, task: str) -> None:
        """Refuse adapters (`LoraFile`s) whose device copies for `task` exceed `gpu_memory`, or without it the device
        memory available to them (`DeviceMemory`) less a margin."""
        model = self.transformer_for(task)
        fp8 = fp8_layers(model)
        extended = getattr(model, "offload", None) is None  # `activate` extends no weight under layer-wise offload
        need = sum(lora_device_bytes(lora, task, model.dtype.itemsize, fp8, extended) for lora in files)
        check_device_budget(
            need, [lora.name for lora in files], self.gpu_memory, self.device_memory.available(partition_for(task))
        )

    def applied(self, task: str, adapters: list) -> list[tuple[str, float]]:
        """`(name, scale)` of the adapters a call on `task` ran with: those merged into its partition first, then its
        own."""
        return self.merged.get(partition_for(task), []) + [(adapter.name, scale) for adapter, scale in adapters]
