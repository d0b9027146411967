"""Checkpoint key layouts of the MiniMax-H3 transformer and the conversion of the original release's to ours.

Our state-dict keys equal diffusers'. The original release (and ComfyUI single files) use other names, a fused
`qkv_proj` and an `mlp.fc1` whose halves are `[gate; value]` where diffusers' SwiGLU reads `[value; gate]`
(diffusers' `convert_minimax_h3_transformer_checkpoint_to_diffusers` documents the mapping; docs/model.md,
"Checkpoint layouts").
"""

from typing import Callable, Iterator

import torch

from h3gen.errors import CheckpointError

QKV_LAYOUTS = ("interleaved", "stacked")

# Substring renames from the original names to diffusers', applied in order after `blocks.` -> `transformer_blocks.`.
_RENAMES = (
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
    (".attn.q_norm.", ".attn.norm_q."),
    (".attn.k_norm.", ".attn.norm_k."),
    (".attn.out_proj.", ".attn.to_out.0."),
    (".mlp.fc1.", ".ff.net.0.proj."),
    (".mlp.fc2.", ".ff.net.2."),
)
_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# Keys that are computed, never loaded.
_COMPUTED = ("rope.inv_freq",)

# A converted tensor: (target key, function of the source tensor).
Conversion = list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def detect_layout(keys: list[str]) -> str:
    """ "original" if the keys use the original release's names (`blocks.N.attn.qkv_proj`, `final_layer.*`),
    "diffusers" otherwise."""
    stripped = [_strip_prefix(k) for k in keys]
    if any(k.startswith(("blocks.", "final_layer.")) or ".qkv_proj." in k for k in stripped):
        return "original"
    return "diffusers"


class LazyRows:
    """A converted tensor that reads only the rows it is asked for from a lazy safetensors slice.

    `source_ranges(a, b)` maps target rows [a, b) to source row ranges; indexing supports `[a:b]` and `[:]`, which
    is all a tensor-parallel module asks of a checkpoint tensor (`load_shard`)."""

    def __init__(self, source, shape, source_ranges):
        self.source, self.shape, self.source_ranges = source, tuple(shape), source_ranges

    def get_shape(self):
        return list(self.shape)

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a converted checkpoint tensor can only be read by row ranges")
        start, stop, _ = key.indices(self.shape[0])
        return torch.cat([self.source[a:b] for a, b in self.source_ranges(start, stop)], dim=0)


def _lazy(x) -> bool:
    return not isinstance(x, torch.Tensor)


def _split_qkv(index: int, heads: int, head_dim: int, qkv_layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def take(weight):
        if _lazy(weight):  # a tensor-parallel rank: read only its heads' rows of this part
            return LazyRows(weight, (heads * head_dim, weight.get_shape()[1]), ranges)
        if qkv_layout == "interleaved":  # rows [head0: q k v, head1: q k v, ...]
            return weight.unflatten(0, (heads, 3, head_dim))[:, index].flatten(0, 1).contiguous()
        return weight.chunk(3, dim=0)[index].contiguous()  # rows [q; k; v]

    def ranges(start: int, stop: int) -> list[tuple[int, int]]:
        if qkv_layout == "stacked":
            offset = index * heads * head_dim
            return [(offset + start, offset + stop)]
        out = []  # interleaved: each head's rows of this part lie at head * 3D + index * D
        for row in range(start, stop):
            source = (row // head_dim) * 3 * head_dim + index * head_dim + row % head_dim
            if out and out[-1][1] == source:
                out[-1] = (out[-1][0], source + 1)
            else:
                out.append((source, source + 1))
        return out

    return take


def _swap_halves(weight):
    """`[gate; value]` (the original fc1) -> `[value; gate]` (diffusers' SwiGLU)."""
    if _lazy(weight):
        rows = weight.get_shape()[0]
        half = rows // 2

        def ranges(start: int, stop: int) -> list[tuple[int, int]]:
            out = []  # target rows < half are the source's second half, the rest its first half
            if start < half:
                out.append((half + start, half + min(stop, half)))
            if stop > half:
                out.append((max(start, half) - half, stop - half))
            return out

        return LazyRows(weight, weight.get_shape(), ranges)
    gate, value = weight.chunk(2, dim=0)
    return torch.cat([value, gate], dim=0)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def convert_key(key: str, layout: str, heads: int, head_dim: int, qkv_layout: str = "interleaved") -> Conversion:
    """The diffusers-layout tensors one source tensor becomes (none for computed buffers).

    Args:
        key: source key. layout: "diffusers" or "original". heads, head_dim: attention geometry (to split a fused
        per-head-interleaved qkv). qkv_layout: "interleaved" or "stacked".
    """
    if qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {qkv_layout!r}.")
    key = _strip_prefix(key)
    if key in _COMPUTED:
        return []
    if layout == "diffusers":
        return [(key, _identity)]
    if key == "adaln_t_table" or key.startswith("adaln_t_table"):
        raise CheckpointError(
            "This is a pruned MiniMax-H3 checkpoint (it has adaln_t_table instead of the timestep MLP); "
            "only unpruned checkpoints are supported."
        )
    if key.startswith("blocks."):
        key = "transformer_blocks." + key[len("blocks.") :]
    for old, new in _RENAMES:
        key = key.replace(old, new)
    if key.endswith(".attn.qkv_proj.weight"):
        stem = key[: -len("qkv_proj.weight")]
        return [(f"{stem}to_{name}.weight", _split_qkv(i, heads, head_dim, qkv_layout)) for i, name in enumerate("qkv")]
    if key.endswith(".ff.net.0.proj.weight"):
        return [(key, _swap_halves)]
    return [(key, _identity)]


def to_original_layout(
    state_dict: dict[str, torch.Tensor], heads: int, head_dim: int, qkv_layout: str = "interleaved"
) -> dict[str, torch.Tensor]:
    """Rewrite a diffusers-layout state dict in the original release's key layout (the inverse of `convert_key`).
    Used to produce original-layout test checkpoints and for exporting."""
    reverse = {new: old for old, new in _RENAMES}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            continue
        if key.endswith(".attn.to_q.weight"):
            stem = key[: -len("to_q.weight")]
            q, k, v = (state_dict[f"{stem}to_{n}.weight"] for n in "qkv")
            if qkv_layout == "interleaved":
                fused = torch.stack([t.unflatten(0, (heads, head_dim)) for t in (q, k, v)], dim=1).flatten(0, 2)
            else:
                fused = torch.cat([q, k, v], dim=0)
            key, tensor = f"{stem}qkv_proj.weight", fused
        elif key.endswith(".ff.net.0.proj.weight"):
            value, gate = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate, value], dim=0)
        key = _rename_back(key, reverse)
        if key.startswith("transformer_blocks."):
            key = "blocks." + key[len("transformer_blocks.") :]
        out[key] = tensor.contiguous()
    return out


def _rename_back(key: str, reverse: dict[str, str]) -> str:
    # Longest names first, through placeholders, so a short name never re-matches inside a replaced one
    # (`time_embedder.proj_in.` must not become `time_embedder.video_patch_proj.`).
    ordered = sorted(reverse.items(), key=lambda kv: -len(kv[0]))
    for i, (new, _) in enumerate(ordered):
        key = key.replace(new, f"\0{i}\0")
    for i, (_, old) in enumerate(ordered):
        key = key.replace(f"\0{i}\0", old)
    return key


def iter_converted(
    items: Iterator[tuple[str, torch.Tensor]], layout: str, heads: int, head_dim: int, qkv_layout: str
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Stream `(source key, target key, tensor)` for every target tensor the source tensors convert to."""
    for source_key, tensor in items:
        for target_key, transform in convert_key(source_key, layout, heads, head_dim, qkv_layout):
            yield source_key, target_key, transform(tensor)
