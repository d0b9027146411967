"""The MiniMax-H3 transformer (`H3Transformer`): a single-stream DiT over one packed sequence. Its layers are in
`transformer_blocks`, its architecture and checkpoint constants in `transformer_config`.

One packed 1-D sequence holds text rows (Qwen3-VL hidden states), conditioning rows, stereo audio latent rows and
video latent rows under full bidirectional self-attention. Modalities differ only in their input projections, a
per-row AdaLN table indexed by `(timestep, modality)` and two output heads (docs/model.md, "Transformer").

Same config fields, state-dict keys, forward arguments and outputs as diffusers 0.42.1's
`MiniMaxH3Transformer3DModel`, and the same op order, so the `exact` tier reproduces it. What makes it fast or
distributed is reached only through three seams:
  - every linear comes from a `LinearFactory` (`h3gen.linear`), so tensor-parallel and quantized linears slot in;
  - attention goes through `AttentionCore`, a parameter-free module that Ulysses can replace;
  - `H3TransformerBlock` is self-contained (its AdaLN projection included), so offload can move it as a unit.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from h3gen.kernels.vsa_h3 import SparseSwitch
from h3gen.linear import LinearFactory, LinearSpec, dense_linear
from h3gen.loading import save_component
from h3gen.pipelines.h3.loader import load_transformer
from h3gen.pipelines.h3.transformer_blocks import (
    H3AdaLNOut,
    H3RotaryPosEmbed,
    H3TimestepEmbedding,
    H3TokenRefiner,
    H3TransformerBlock,
    compute_dtype,
    timestep_sinusoids,
)
from h3gen.pipelines.h3.transformer_config import KEEP_FP32_MODULES, NUM_MODALITIES, H3TransformerConfig


@dataclass
class H3TransformerOutput:
    """Velocities for every video row (`sample`, `(B, N_video, video_patch_dim)`) and audio row (`audio_sample`,
    `(B, N_audio, audio_in_channels)`), in the order of `video_indices` / `audio_indices`. Conditioning rows are
    included; masking them is the caller's job."""

    sample: torch.Tensor
    audio_sample: torch.Tensor

    def __iter__(self):
        return iter((self.sample, self.audio_sample))


@dataclass
class AdaLNTables:
    """Every block's AdaLN table and `norm_out`'s for all steps of one request, computed once before denoising.

    The sigma schedule is fixed per request, so each block's 260 M-parameter AdaLN projection is run once over all
    steps' distinct timesteps (a few hundred rows) instead of once per step: its weights are read once per request
    and the block forward does no AdaLN GEMM. Step `i` owns timestep rows `offsets[i] : offsets[i] + counts[i]`.
    Batching changes the GEMM's shape, so results may differ from per-step projection in the last bits: the
    `exact` tier does not use it.
    """

    blocks: list[torch.Tensor]  # per block: (sum K * 3, 6 * hidden)
    final: torch.Tensor  # (sum K, 2 * hidden)
    offsets: list[int]
    counts: list[int]

    def for_step(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Views of step `step`'s tables: per block `(K * 3, 6 * hidden)`, and `(K, 2 * hidden)`."""
        start, count = self.offsets[step], self.counts[step]
        return [t[start * 3 : (start + count) * 3] for t in self.blocks], self.final[start : start + count]


class H3Transformer(nn.Module):
    """MiniMax-H3 transformer (see the module docstring). Build with `from_config` / `from_pretrained`."""

    keep_fp32_modules = KEEP_FP32_MODULES

    def __init__(
        self,
        config: H3TransformerConfig | None = None,
        *,
        linear_factory: LinearFactory | None = None,
        gates: bool = False,
    ):
        """`gates=True` builds a VSA student: every block's attention has `to_gate_compress` (its checkpoint holds
        `transformer_blocks.{i}.attn.to_gate_compress.weight`), and runs VSA-H3 whenever a plan is set."""
        super().__init__()
        cfg = config if config is not None else H3TransformerConfig()
        self.config = cfg
        self.gates = gates
        # The running forward's sparse attention plan, shared by every block's attention core (`kernels.vsa_h3`).
        self.sparse = SparseSwitch()
        make_linear = linear_factory or dense_linear
        hidden = cfg.hidden_size

        # 1. Per-modality input projections (the two patch projections are float32 islands).
        self.proj_in = make_linear(LinearSpec(cfg.video_patch_dim, hidden, True, kind="embed", fp32=True))
        self.audio_proj_in = make_linear(LinearSpec(cfg.audio_in_channels, hidden, True, kind="embed", fp32=True))
        self.context_embedder = make_linear(LinearSpec(cfg.text_dim, hidden, True, kind="embed"))
        # 2. Timestep MLP, shared by every AdaLN projection.
        self.time_embedder = H3TimestepEmbedding(
            cfg.freq_dim, cfg.time_embed_hidden_dim, cfg.time_embed_dim, make_linear
        )
        # 3. Rotary angles over the packed (t, h, w) grid.
        self.rope = H3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta)
        # 4. Text refiner, then the block stack.
        self.token_refiner = H3TokenRefiner(cfg, make_linear)
        self.transformer_blocks = nn.ModuleList(
            [H3TransformerBlock(cfg, make_linear, gates=gates, sparse=self.sparse) for _ in range(cfg.num_layers)]
        )
        # 5. Output norm and the two heads (float32 islands), each run over every row.
        self.norm_out = H3AdaLNOut(hidden, cfg.time_embed_dim, cfg.final_norm_eps, make_linear)
        self.proj_out = make_linear(LinearSpec(hidden, cfg.video_patch_dim, True, kind="head", fp32=True))
        self.audio_proj_out = make_linear(LinearSpec(hidden, cfg.audio_in_channels, True, kind="head", fp32=True))
        # The running request's first-block step cache (`step_cache.StepCache`, quality high), or None.
        self.step_cache = None

    @classmethod
    def from_config(cls, config: dict[str, Any] | H3TransformerConfig, **kwargs) -> "H3Transformer":
        """Random-initialised model from a config dict (diffusers `config.json` contents) or config object."""
        if isinstance(config, dict):
            config = H3TransformerConfig.from_dict(config)
        return cls(config, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        folder,
        torch_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        *,
        linear_factory: LinearFactory | None = None,
        qkv_layout: str = "interleaved",
        parallel=None,
        quantization: str | None = None,
        skip_prefixes: tuple[str, ...] = (),
        tensors=None,
        gates: bool | None = None,
        adapter=None,
    ) -> "H3Transformer":
        """Load from a folder holding `config.json` and safetensors weights (one file or a sharded index), in the
        diffusers key layout or the original release's. Float32 islands stay float32; everything else becomes
        `torch_dtype`. Built on the meta device and filled one tensor at a time (no full-precision copy).

        `qkv_layout` only matters for the original layout: "interleaved" (per-head `[q k v]`, the MiniMaxAI shards)
        or "stacked" (`[q; k; v]`, published single files). `parallel` (an `h3gen.parallel.ParallelState`) loads
        this rank's tensor-parallel shard (reading only that part of each tensor) and splits the sequence (Ulysses).
        `quantization="mxfp4"` stores the block linears (q/k/v/out, SwiGLU, AdaLN) as MXFP4, quantized while each
        tensor is read. Tensors under `skip_prefixes` are not read and stay on the meta device (a rank that maps
        the blocks from a shared host store skips "transformer_blocks."). `tensors` (`(key, tensor)` pairs in the
        diffusers layout) replaces the folder's weight files (random weights at released dims). `gates` builds a VSA
        student (with `to_gate_compress` in every block); None decides from the checkpoint's keys. `adapter` (a
        `fasth3_adapter.FastH3Adapter`) is merged into the weights as they load: the model is then the student.
        """
        return load_transformer(
            cls,
            folder,
            torch_dtype=torch_dtype,
            device=device,
            linear_factory=linear_factory,
            qkv_layout=qkv_layout,
            parallel=parallel,
            quantization=quantization,
            skip_prefixes=skip_prefixes,
            tensors=tensors,
            gates=gates,
            adapter=adapter,
        )

    @torch.no_grad()
    def precompute_adaln(self, step_timesteps: list[torch.Tensor]) -> AdaLNTables:
        """AdaLN tables for a whole request: `step_timesteps[i]` is step i's `(K_i,)` distinct timesteps (the
        `timestep` argument `forward` would get). Pass the result to `forward(..., adaln_tables=, step=i)`."""
        counts = [t.numel() for t in step_timesteps]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        timesteps = torch.cat([t.to(self.device) for t in step_timesteps])
        temb = self.time_embedder(
            timestep_sinusoids(timesteps, self.config.freq_dim).to(compute_dtype(self.time_embedder.linear_1))
        )
        blocks = [block.adaln_proj.table(temb) for block in self.transformer_blocks]
        return AdaLNTables(blocks=blocks, final=self.norm_out.table(temb), offsets=offsets, counts=counts)

    def save_pretrained(self, folder, max_shard_bytes: int | None = None):
        """Write `config.json` and the weights in diffusers' layout (loadable by diffusers and by us)."""
        config = self.config.to_dict()
        if getattr(self, "quantization", None):
            config["quantization_config"] = {"quant_method": self.quantization}
        return save_component(folder, config, self.state_dict(), max_shard_bytes=max_shard_bytes)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the block stack (the model's working precision)."""
        return compute_dtype(self.context_embedder)

    @property
    def device(self) -> torch.device:
        return self.context_embedder.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
        adaln_tables: AdaLNTables | None = None,
        step: int | None = None,
    ) -> H3TransformerOutput | tuple[torch.Tensor, torch.Tensor]:
        """One denoising forward over a packed sequence of S = N_text + N_video + N_audio rows.

        Args:
            hidden_states: `(B, N_video, video_patch_dim)` patchified video rows in `video_indices` order
                (conditioning rows first).
            audio_hidden_states: `(B, N_audio, audio_in_channels)` audio rows in `audio_indices` order.
            encoder_hidden_states: `(B, N_text, text_dim)` text-encoder states in `text_indices` order.
            timestep: `(K,)` the distinct timesteps, unscaled in [0, 1], t = 1 clean.
            timestep_indices: `(S,)` long, per row index into `timestep`.
            token_tags: `(S,)` long, per row modality: 0 video, 1 text, 2 audio.
            position_ids: `(S, 3)` (t, h, w) rotary coordinates (float64 from packing; used in float32).
            video_indices, audio_indices, text_indices: 1-D long, sequence positions of each modality's rows.
            attention_kwargs: accepted for diffusers compatibility; LoRA scaling is not supported yet and a
                `scale` other than 1.0 is rejected.
            return_dict: return `H3TransformerOutput` (default) or a `(video, audio)` tuple.
            adaln_tables, step: precomputed AdaLN tables (`precompute_adaln`) and this forward's step in them; the
                tables must have been built from the same `timestep`.

        Returns:
            video velocity `(B, N_video, video_patch_dim)` and audio velocity `(B, N_audio, audio_in_channels)`,
            float32 when the heads are float32 (the released checkpoint).
        """
        if attention_kwargs and attention_kwargs.get("scale", 1.0) != 1.0:
            raise ValueError("LoRA scaling via attention_kwargs['scale'] is not supported by H3Transformer yet.")
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must be a (seq_len, 3) tensor, got {list(position_ids.shape)}.")
        seq_len = position_ids.shape[0]
        if token_tags.shape != (seq_len,) or timestep_indices.shape != (seq_len,):
            raise ValueError(
                "token_tags and timestep_indices must be (seq_len,) tensors matching position_ids, got "
                f"{list(token_tags.shape)} and {list(timestep_indices.shape)} for seq_len={seq_len}."
            )
        rows = video_indices.numel() + audio_indices.numel() + text_indices.numel()
        if rows != seq_len:
            raise ValueError(f"The index tensors address {rows} rows but position_ids has {seq_len}.")

        rotary_emb = self.rope(position_ids)

        # 1. Project each modality (inputs aligned with each projection's dtype: the patch projections are float32
        # islands) and scatter into the packed buffer, which takes the text stream's dtype.
        video = self.proj_in(hidden_states.to(compute_dtype(self.proj_in)))
        audio = self.audio_proj_in(audio_hidden_states.to(compute_dtype(self.audio_proj_in)))
        text = self.token_refiner(self.context_embedder(encoder_hidden_states.to(compute_dtype(self.context_embedder))))
        x = text.new_zeros((text.shape[0], seq_len, text.shape[-1]))
        x = x.index_copy(1, text_indices, text)
        x = x.index_copy(1, video_indices, video.to(text.dtype))
        x = x.index_copy(1, audio_indices, audio.to(text.dtype))

        # 2. One float32 embedding per distinct timestep; each AdaLN projection activates and casts it itself
        # (or the request's tables were computed up front).
        adaln_indices = timestep_indices * NUM_MODALITIES + token_tags
        if adaln_tables is not None:
            temb = None
            block_tables, final_table = adaln_tables.for_step(step)
        else:
            temb = timestep_sinusoids(timestep, self.config.freq_dim)
            temb = self.time_embedder(temb.to(compute_dtype(self.time_embedder.linear_1)))
            block_tables, final_table = [None] * len(self.transformer_blocks), None

        blocks = self.transformer_blocks

        def run_block(index: int, x: torch.Tensor) -> torch.Tensor:
            return blocks[index](x, temb, adaln_indices, rotary_emb, modulation=block_tables[index])

        if self.step_cache is not None:  # may skip blocks 1..N-1 and reuse their last residual
            x = self.step_cache.run_blocks(len(blocks), x, run_block, blocks[0] if len(blocks) else None)
        else:
            for index in range(len(blocks)):
                x = run_block(index, x)

        # 3. Both heads over every row, then each modality's rows are selected.
        x = self.norm_out(x, temb, timestep_indices, table=final_table).to(compute_dtype(self.proj_out))
        video_out = self.proj_out(x).index_select(1, video_indices)
        audio_out = self.audio_proj_out(x).index_select(1, audio_indices)
        if not return_dict:
            return video_out, audio_out
        return H3TransformerOutput(sample=video_out, audio_sample=audio_out)
