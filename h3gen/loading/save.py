"""Writing a component folder: `config.json` plus safetensors weights, sharded with an index when large."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


def save_component(
    folder, config: dict, state_dict: dict[str, torch.Tensor], *, max_shard_bytes: int | None = None
) -> Path:
    """Write `config.json` and the tensors (contiguous, CPU) into `folder` in diffusers' layout. With
    `max_shard_bytes`, tensors are split over `diffusion_pytorch_model-0000i-of-0000n.safetensors` files listed in
    `diffusion_pytorch_model.safetensors.index.json`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME))
        return folder
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"{stem}-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{WEIGHTS_NAME}.index.json").write_text(json.dumps(index, indent=2))
    return folder
