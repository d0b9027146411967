"""Tiny LoRA files in every MiniMax-H3 format, written for a given transformer, and diffusers' loader as the
reference (its `MiniMaxH3LoraLoaderMixin`, the one the modular pipeline inherits, on a holder of the partitions)."""

import torch
from safetensors.torch import save_file

TURBO_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")


def diffusers_shapes(model, blocks_only: bool = False) -> dict[str, tuple[int, int]]:
    """Every linear of an H3 transformer (ours or diffusers'): diffusers module name -> (out, in)."""
    shapes = {}
    for name, module in model.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features") and name:
            if blocks_only and not name.startswith(("transformer_blocks.", "token_refiner.")):
                continue
            shapes[name] = (module.out_features, module.in_features)
    return shapes


def native_shapes(config) -> dict[str, tuple[int, int]]:
    """Every LoRA-able module of the original checkpoint's layout: native name -> (out, in)."""
    hidden, inner = config.hidden_size, config.num_attention_heads * config.attention_head_dim
    block = {
        "attn.qkv_proj": (3 * inner, hidden),
        "attn.out_proj": (hidden, inner),
        "mlp.fc1": (2 * config.ffn_dim, hidden),
        "mlp.fc2": (hidden, config.ffn_dim),
    }
    shapes = {}
    for i in range(config.num_layers):
        shapes |= {f"blocks.{i}.{k}": v for k, v in block.items()}
        shapes[f"blocks.{i}.adaln_proj.linear"] = (18 * hidden, config.time_embed_dim)
    for i in range(config.num_refiner_layers):
        shapes |= {f"token_refiner.blocks.{i}.{k}": v for k, v in block.items()}
    shapes |= {
        "video_patch_proj": (hidden, config.video_patch_dim),
        "audio_patch_proj": (hidden, config.audio_in_channels),
        "condition_proj": (hidden, config.text_dim),
        "time_embedder.proj_in": (config.time_embed_hidden_dim, config.freq_dim),
        "time_embedder.proj_out": (config.time_embed_dim, config.time_embed_hidden_dim),
        "final_layer.adaln_proj.linear": (2 * hidden, config.time_embed_dim),
        "final_layer.video_out": (config.video_patch_dim, hidden),
        "final_layer.audio_out": (config.audio_in_channels, hidden),
    }
    return shapes


def random_factors(
    shapes: dict[str, tuple[int, int]], rank: int, seed: int, scale: float = 0.3, ranks: dict[str, int] | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A (rank, in), B (out, rank)) random, `ranks` overriding the rank per module."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for module, (rows, cols) in shapes.items():
        r = (ranks or {}).get(module, rank)
        out[module] = (
            torch.randn(r, cols, generator=generator) * scale,
            torch.randn(rows, r, generator=generator) * scale,
        )
    return out


def write_diffusers(path, factors, *, prefix: str = "transformer.", peft: bool = False, metadata=None) -> None:
    """diffusers names: `<prefix><module>.lora_A.weight`, or a peft dump `<module>.lora_A.default.weight`."""
    tensors = {}
    for module, (down, up) in factors.items():
        infix = ".default" if peft else ""
        head = "" if peft else prefix
        tensors[f"{head}{module}.lora_A{infix}.weight"] = down.contiguous()
        tensors[f"{head}{module}.lora_B{infix}.weight"] = up.contiguous()
    save_file(tensors, str(path), metadata=metadata)


def interleave_qkv(up: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[q_all; k_all; v_all]` rows -> `[head0: q k v, head1: q k v, ...]` (the raw checkpoint's layout)."""
    q, k, v = up.chunk(3)
    heads = q.shape[0] // head_dim
    parts = [t.reshape(heads, head_dim, -1) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(up.shape)


def write_native(
    path,
    factors,
    *,
    style: str = "native",
    alphas: dict[str, float] | None = None,
    prefix: str = "",
    head_dim: int | None = None,
    metadata=None,
) -> None:
    """Native module names. `style`: "native" (`lora_A` / `lora_B`), "kohya" (`lora_down` / `lora_up`), "musubi"
    (kohya with flattened `lora_unet_` names), "diffsynth" (`.lora_A.default.`; with `head_dim`, the fused QKV's B
    is written per-head interleaved). `alphas` adds `.alpha` tensors."""
    down_name, up_name = {
        "native": ("lora_A", "lora_B"),
        "kohya": ("lora_down", "lora_up"),
        "musubi": ("lora_down", "lora_up"),
        "diffsynth": ("lora_A.default", "lora_B.default"),
    }[style]
    tensors = {}
    for module, (down, up) in factors.items():
        if head_dim is not None and module.endswith("qkv_proj"):
            up = interleave_qkv(up, head_dim)
        base = f"lora_unet_{module.replace('.', '_')}" if style == "musubi" else f"{prefix}{module}"
        tensors[f"{base}.{down_name}.weight"] = down.contiguous()
        tensors[f"{base}.{up_name}.weight"] = up.contiguous()
        if alphas and module in alphas:
            tensors[f"{base}.alpha"] = torch.tensor(alphas[module])
    save_file(tensors, str(path), metadata=metadata)


def diffusers_holder(transformer=None, transformer_ref=None):
    """An object diffusers' H3 LoRA loader accepts as its pipeline: the partitions given, no others."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin  # heavy optional dependency

    class Holder(MiniMaxH3LoraLoaderMixin):
        hf_device_map = None

        @property
        def components(self):
            return {
                k: v
                for k, v in (("transformer", self.transformer), ("transformer_ref", self.transformer_ref))
                if v is not None
            }

    holder = Holder()
    holder.transformer, holder.transformer_ref = transformer, transformer_ref
    return holder
