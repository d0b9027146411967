"""Loading K3 and Kimi-Linear checkpoint folders into `K3ForCausalLM`.

Key renames (checkpoint -> model):
- `language_model.` (K3's outer wrapper) is stripped; `language_model.layers.` becomes `model.layers.`;
- `.block_sparse_moe.` -> `.mlp.` (Kimi-Linear and K3 name their FFN so);
- `self_attn.A_log` is flattened to its first `num_heads` entries (K3 stores it 1-D, Kimi-Linear `[1, 1, H, 1]`);
- a fused dense `gate_up_proj.weight` (`[gate; up]`, the layout sglang's K3 MLP holds) is split into
  `gate_proj` / `up_proj`;
- MXFP4 experts keep `weight_packed` / `weight_scale` (the `MXFP4Linear` buffers); a 4-D scale is reduced.

The model is built on the meta device through the linear factory (tensor-parallel factories cut each tensor to
their shard in `load_shard`), and the tensors are streamed in one at a time by `h3gen.loading.assign_tensors`.
"""

from pathlib import Path

import torch

from h3gen.errors import CheckpointError
from h3gen.linear import make_linear_factory
from h3gen.loading.files import read_json
from h3gen.loading.load import assign_tensors, meta_parameters, read_tensors
from h3gen.pipelines.k3.config import K3Config

EXPERT_KIND = "moe.expert"


def rename_key(key: str) -> str | None:
    """A checkpoint key -> the model's key (None: a tensor the text model does not hold)."""
    if key.startswith("language_model."):
        key = key[len("language_model.") :]
        if key.startswith(("layers.", "embed_tokens.", "norm.", "output_attn_res_")):
            key = "model." + key
    if key.startswith(("vision_tower.", "mm_projector.")):
        return key
    return key.replace(".block_sparse_moe.", ".mlp.")


def convert_tensor(key: str, tensor: torch.Tensor, config: K3Config) -> torch.Tensor:
    if key.endswith("self_attn.A_log"):
        flat = tensor.reshape(-1)
        if flat.numel() < config.linear_num_heads:
            raise CheckpointError(f"{key} has {flat.numel()} entries; at least {config.linear_num_heads} expected.")
        return flat[: config.linear_num_heads]
    if key.endswith("weight_scale") and tensor.ndim == 4:
        return tensor[:, 0, :, 0]
    return tensor


def split_gate_up(key: str, target: str, tensor: torch.Tensor):
    """A fused `gate_up_proj.weight` `[2I, D]` (gate rows first, non-interleaved) -> `gate_proj` and `up_proj`."""
    if tensor.ndim != 2 or tensor.shape[0] % 2:
        raise CheckpointError(f"{key} has shape {list(tensor.shape)}; expected [2 * intermediate, hidden].")
    gate, up = tensor.chunk(2, dim=0)
    stem = target[: -len("gate_up_proj.weight")]
    yield key, stem + "gate_proj.weight", gate
    yield key, stem + "up_proj.weight", up


def expert_linear_factory(base, config: K3Config):
    """Routed experts as `MXFP4Linear` when the checkpoint stores them MXFP4, `base` (dense when None) for everything
    else."""
    return make_linear_factory(
        quantization="mxfp4" if config.experts_mxfp4 else None, quantized_kinds=(EXPERT_KIND,), base=base
    )


def load_k3(cls, folder, *, torch_dtype: torch.dtype = torch.bfloat16, device=None, linear_factory=None):
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint folder {folder} does not exist.")
    config = K3Config.from_dict(read_json(folder / "config.json"))
    device = torch.device(device) if device is not None else torch.device("cpu")
    linear = expert_linear_factory(linear_factory, config)
    with meta_parameters():
        model = cls(config, linear)

    def tensors():
        for key, tensor in read_tensors(folder):
            target = rename_key(key)
            if target is None:
                continue
            if target.endswith(".gate_up_proj.weight"):  # sglang's fused layout: [gate; up] along the output
                yield from split_gate_up(key, target, tensor)
                continue
            yield key, target, convert_tensor(target, tensor, config)

    assign_tensors(
        model, tensors(), dtype=torch_dtype, device=device, keep_fp32_modules=cls.keep_fp32_modules, source=str(folder)
    )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # quantized experts compute in the model's working dtype
        if hasattr(module, "compute_dtype") and hasattr(module, "weight_packed"):
            module.compute_dtype = torch_dtype
    return model.eval()
