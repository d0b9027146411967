"""Loading MiniMax-H3 transformer checkpoints: the diffusers key layout or the original release's (converted by
`layouts`), streamed one tensor at a time into a model built on the meta device through the linear factory
(tensor-parallel shards, MXFP4 weights)."""

from pathlib import Path

import torch
from safetensors import safe_open

from h3gen.errors import CheckpointError
from h3gen.linear import QUANTIZATIONS, make_linear_factory
from h3gen.loading.files import read_json, safetensors_files
from h3gen.loading.load import assign_tensors, keeps_fp32, meta_parameters, read_tensors
from h3gen.parallel.sequence import enable_sequence_parallel
from h3gen.pipelines.h3.fasth3 import GATE_SUFFIX
from h3gen.pipelines.h3.fasth3_adapter import FastH3Adapter, merge_stream
from h3gen.pipelines.h3.layouts import detect_layout, iter_converted


def _tensor_keys(folder: Path) -> list[str]:
    """The tensor names of a folder's safetensors files (from the index, or from each file's header)."""
    keys = []
    for path, listed in safetensors_files(folder).items():
        if listed is None:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                listed = list(handle.keys())
        keys += listed
    return keys


def transformer_host_bytes(
    cls, folder, torch_dtype: torch.dtype, quantization: str | None = None, adapter: FastH3Adapter | None = None
) -> int:
    """Bytes a whole (unsharded) transformer from `folder` takes once loaded as `load_transformer` loads it: float32
    islands in float32, other floating tensors in `torch_dtype`, MXFP4 block linears packed (4.25 bits a weight)
    under `quantization` (or the checkpoint's own), gates where the files hold them or `adapter` creates them. A
    host copy sized from the files alone overcounts MXFP4 at load about 3.8x and misses an adapter's gates. Reads
    config.json and the tensor names only; the model is built on the meta device."""
    folder = Path(folder)
    config = read_json(folder / "config.json")
    quantization = quantization or (config.get("quantization_config") or {}).get("quant_method")
    gates = any(key.endswith(GATE_SUFFIX) for key in _tensor_keys(folder)) or (adapter is not None and adapter.gated)
    factory = make_linear_factory(quantization=quantization) if quantization is not None else None
    with meta_parameters():
        model = cls.from_config(config, linear_factory=factory, gates=gates)
    total = 0
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            itemsize = 4 if keeps_fp32(name, cls.keep_fp32_modules) else torch_dtype.itemsize
        else:
            itemsize = tensor.element_size()
        total += tensor.numel() * itemsize
    return total


def load_transformer(
    cls,
    folder,
    *,
    torch_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    linear_factory=None,
    qkv_layout: str = "interleaved",
    parallel=None,
    quantization: str | None = None,
    skip_prefixes: tuple[str, ...] = (),
    tensors=None,
    gates: bool | None = None,
    adapter: FastH3Adapter | None = None,
):
    """Build `cls` (an `H3Transformer`) from `folder/config.json` on the meta device and stream its weights in.
    `tensors` (an iterable of `(key, tensor)` in the diffusers layout) replaces the folder's weight files, e.g.
    random weights made one tensor at a time (`random_weights.random_tensors`).
    Tensors under `skip_prefixes` (e.g. "transformer_blocks.") are not read and stay on the meta device.
    With `parallel` (a `ParallelState`), the model is this rank's TP shard and SP slice. `quantization="mxfp4"`
    stores the block linears as MXFP4, quantizing each full-precision tensor as it is read (a checkpoint saved
    quantized says so in its config and loads as such).

    Accepts the diffusers key layout and the original release's (detected from the keys). `gates` builds a VSA
    student's attention gates (`to_gate_compress`); None builds them when the checkpoint holds them (or `adapter`
    creates them). `adapter` (a `FastH3Adapter`) is merged into the tensors as they stream in, before any slicing,
    quantization or offload (`fasth3_adapter.merge_stream`), after being checked against the model's shapes.
    Returns the model in eval mode on `device` (default CPU).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint folder {folder} does not exist.")
    config = read_json(folder / "config.json")
    class_name = config.get("_class_name")
    if class_name not in (None, "MiniMaxH3Transformer3DModel", cls.__name__):
        raise CheckpointError(f"{folder} holds a {class_name}, not a MiniMax-H3 transformer.")
    device = torch.device(device) if device is not None else torch.device("cpu")
    saved_quantization = (config.get("quantization_config") or {}).get("quant_method")
    quantization = quantization or saved_quantization
    if quantization not in (None, *QUANTIZATIONS):
        raise CheckpointError(f"unknown quantization {quantization!r}; h3gen supports {', '.join(QUANTIZATIONS)}.")
    if parallel is not None or quantization is not None:
        linear_factory = make_linear_factory(parallel=parallel, quantization=quantization, base=linear_factory)
    keys = _tensor_keys(folder) if tensors is None else []
    has_gates = any(key.endswith(GATE_SUFFIX) for key in keys)
    if adapter is not None and adapter.is_student and has_gates:
        raise CheckpointError(
            f"FastH3 adapter {adapter.name} is made for the base model, but {folder.name}/ holds VSA gates already "
            "(a FastH3 student)."
        )
    if gates is None:
        gates = has_gates or (adapter is not None and adapter.gated)
    with meta_parameters():
        model = cls.from_config(config, linear_factory=linear_factory, gates=gates)
    if adapter is not None:
        if adapter.gated and not gates:
            raise CheckpointError(f"FastH3 adapter {adapter.name} creates VSA gates; the model was built without them.")
        with meta_parameters():  # the unsharded, unquantized shapes the file's deltas must fit
            full = cls.from_config(config, gates=gates)
        cfg = full.config
        adapter.check(
            {name: tuple(p.shape) for name, p in full.state_dict().items()}, cfg.num_layers, cfg.num_refiner_layers
        )
    model.quantization = quantization
    if parallel is not None:
        model.parallel_state = parallel
        if parallel.sp > 1:
            enable_sequence_parallel(model, parallel)

    if tensors is not None:
        source = ((key, key, tensor) for key, tensor in tensors)
        if adapter is not None:
            source = merge_stream(adapter, source)
        assign_tensors(
            model,
            source,
            dtype=torch_dtype,
            device=device,
            keep_fp32_modules=cls.keep_fp32_modules,
            source=f"{folder} (generated weights)",
        )
        return _finish(model, torch_dtype, device, skip_prefixes)
    layout = detect_layout(keys)
    cfg = model.config
    # Tensor-parallel ranks read only their shards through lazy slices, in either layout (the original layout's
    # fused q/k/v and swapped SwiGLU halves are converted row range by row range, `layouts.LazyRows`).
    lazy = getattr(model, "parallel_state", None) is not None or bool(skip_prefixes)
    tensors = iter_converted(
        read_tensors(folder, lazy=lazy), layout, cfg.num_attention_heads, cfg.attention_head_dim, qkv_layout
    )
    if adapter is not None:
        tensors = merge_stream(adapter, tensors, lazy=lazy)
    assign_tensors(
        model,
        tensors,
        dtype=torch_dtype,
        device=device,
        keep_fp32_modules=cls.keep_fp32_modules,
        source=f"{folder} ({layout} layout)",
        skip=(lambda key: key.startswith(tuple(skip_prefixes))) if skip_prefixes else None,
    )
    return _finish(model, torch_dtype, device, skip_prefixes)


def _finish(model, torch_dtype, device, skip_prefixes):
    for module in model.modules():  # quantized layers compute in the model's working dtype
        if hasattr(module, "compute_dtype") and hasattr(module, "weight_packed"):
            module.compute_dtype = torch_dtype
    if skip_prefixes:  # every loaded tensor is on `device` already; the skipped ones stay on meta
        return model.eval().requires_grad_(False)
    return model.to(device).eval().requires_grad_(False)
