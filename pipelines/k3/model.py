"""The K3 / Kimi-Linear text model: Kimi Delta Attention and gated MLA layers (`attention.py`) interleaved, dense or
(Latent)MoE feed-forwards with SiLU or SiTU experts (`moe.py` runs the experts), and either the plain residual stream
or block Attention Residuals.

State-dict keys equal the checkpoint's after the loader's renames (`block_sparse_moe` -> `mlp`, A_log flattened),
so `model.layers.{i}.self_attn.q_proj.weight`, `model.layers.{i}.mlp.experts.{e}.w1.weight_packed`, ... Linear
layers come from a `LinearFactory` (tensor parallel and MXFP4 factories plug in there); the math of the fast ops
lives in `h3gen.kernels.kda`, `h3gen.kernels.mla_decode` and `h3gen.kernels.moe`.
"""

import torch
import torch.nn as nn

from h3gen.kernels.embedding import embedding_rows
from h3gen.kernels.gemv import MAX_ROWS, rows_linear
from h3gen.kernels.moe import expert_swiglu_down
from h3gen.kernels.swiglu import swiglu
from h3gen.linear import LinearFactory, LinearSpec, dense_linear, to_mxfp4
from h3gen.pipelines.k3 import moe
from h3gen.pipelines.k3.attention import K3DeltaAttention, K3MLAttention
from h3gen.pipelines.k3.cache import K3Cache, PagedLatentCache
from h3gen.pipelines.k3.config import K3Config
from h3gen.pipelines.k3.layers import K3RMSNorm, fuse_linears, gated_activation, project, project_argmax
from h3gen.pipelines.k3.loader import load_k3
from h3gen.pipelines.k3.moe import K3Expert, K3Router, stack_weights
from h3gen.pipelines.k3.pending_norm import PendingNorm, linear_rows, resolved
from h3gen.pipelines.k3.vision import K3MultiModalProjector, K3VisionConfig, K3VisionTower


class K3MLP(nn.Module):
    """Gated MLP `down(act(gate x, up x))` with SiLU or SiTU: the dense layers and the shared experts."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int, linear: LinearFactory, kind: str = "ffn"):
        super().__init__()
        self.config = config
        self.gate_proj = linear(LinearSpec(hidden, intermediate, False, "column", f"{kind}.up"))
        self.up_proj = linear(LinearSpec(hidden, intermediate, False, "column", f"{kind}.up"))
        self.down_proj = linear(LinearSpec(intermediate, hidden, False, "row", f"{kind}.down"))
        self.fused_in: torch.Tensor | None = None  # [up; gate], see `fuse_projections`

    def fuse_projections(self) -> bool:
        """One GEMM for up and gate (in that order, the layout `swiglu` reads); see `fuse_linears`."""
        if self.fused_in is None:
            self.fused_in = fuse_linears([self.up_proj, self.gate_proj])
        return self.fused_in is not None

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if self.fused_in is not None:
            both = linear_rows(x, self.fused_in)
            if self.config.hidden_act != "situ":
                return project(self.down_proj, swiglu(both))
            up, gate = both.chunk(2, dim=-1)
            return project(self.down_proj, gated_activation(self.config, gate, up))
        x = resolved(x)
        return self.down_proj(gated_activation(self.config, self.gate_proj(x), self.up_proj(x)))


class K3MoE(nn.Module):
    """Routed experts (in a latent space for LatentMoE) plus shared experts at full width:

        w, ids = router(x)                         on the full width
        h = down(x)                                LatentMoE only
        y = sum_k w_k E_{ids_k}(h)                 E(h) = w2 act(w1 h, w3 h)
        y = up(RMSNorm(y))                         LatentMoE only (the norm when latent_moe_use_norm)
        out = y + shared(x)

    How the routed sum runs (grouped GEMMs, stacked blocks, per-pair GEMVs, dense or MXFP4) is in `moe.py`;
    `routed` picks one by batch size and by how the experts hold their weights.
    """

    def __init__(self, config: K3Config, linear: LinearFactory):
        super().__init__()
        self.config = config
        d = config.hidden_size
        width = config.routed_expert_hidden_size or d
        self.gate = K3Router(config)
        if config.routed_expert_hidden_size:
            self.routed_expert_down_proj = linear(LinearSpec(d, width, False, "replicated", "moe.latent"))
            if config.latent_moe_use_norm:
                self.routed_expert_norm = K3RMSNorm(width, config.rms_norm_eps)
            self.routed_expert_up_proj = linear(LinearSpec(width, d, False, "replicated", "moe.latent"))
        self.experts = nn.ModuleList(
            K3Expert(width, config.moe_intermediate_size, linear) for _ in range(config.num_experts)
        )
        if config.num_shared_experts:
            self.shared_experts = K3MLP(
                config, d, config.moe_intermediate_size * config.num_shared_experts, linear, "ffn"
            )
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # (up_gate [E, 2I, W], down [E, W, I])
        # MXFP4 experts stacked: ((packed, scales) of up_gate, (packed, scales) of down)
        self.stacked_mxfp4: tuple | None = None
        self.shared_in_stack = False  # the shared expert is stacked expert E (see `stack_experts`)
        # (zeros [R, 1] int64, ones [R, 1] float32): the one-slot routing of the shared expert's decode tail
        self.one_slot: tuple[torch.Tensor, torch.Tensor] | None = None

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gated_activation(self.config, gate, up)

    @torch.no_grad()
    def stack_experts(self) -> bool:
        """Move the experts' weights into stacked tensors (`moe.stack_weights`; do it after moving the model to its
        device): dense experts into `stacked` = (`up_gate` `[E, 2I, W]`, `down` `[E, W, I]`), MXFP4 experts' packed
        bytes and scales the same way (`stacked_mxfp4`). Few-token batches then pick their experts on the device,
        with no host synchronisation. Returns False, changing nothing, for other layers."""
        if self.stacked is not None or self.stacked_mxfp4 is not None:
            return True
        layers = [layer for expert in self.experts for layer in (expert.w1, expert.w3, expert.w2)]
        if all(hasattr(layer, "weight_packed") for layer in layers):
            packed = stack_weights(list(self.experts), "weight_packed")
            scales = stack_weights(list(self.experts), "weight_scale")
            self.stacked_mxfp4 = ((packed[0], scales[0]), (packed[1], scales[1]))
        elif all(
            isinstance(getattr(layer, "weight", None), torch.Tensor) and not hasattr(layer, "weight_packed")
            for layer in layers
        ):
            shared = self._mergeable_shared_expert()
            self.stacked = stack_weights(list(self.experts), "weight", shared)
            self.shared_in_stack = shared is not None
        else:
            return False
        down = getattr(getattr(self, "shared_experts", None), "down_proj", None)
        if not self.shared_in_stack and type(down) is nn.Linear and down.bias is None:
            self.one_slot = (
                torch.zeros(MAX_ROWS, 1, dtype=torch.long, device=down.weight.device),
                torch.ones(MAX_ROWS, 1, dtype=torch.float32, device=down.weight.device),
            )
        return True

    def _mergeable_shared_expert(self) -> "K3MLP | None":
        """The shared expert when it can run as one more stacked expert (same input width and intermediate size as
        the routed experts, one of it, plain bf16/fp32 linears like theirs): then few-token batches route every token
        to it too, with weight 1, and its three GEMMs, activation and add disappear from a decode step."""
        c = self.config
        shared = getattr(self, "shared_experts", None)
        if shared is None or c.num_shared_experts != 1 or c.routed_expert_hidden_size:
            return None
        layers = (shared.up_proj, shared.gate_proj, shared.down_proj)
        first = self.experts[0]
        if any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
            return None
        if (
            shared.up_proj.weight.shape != first.w3.weight.shape
            or shared.down_proj.weight.shape != first.w2.weight.shape
            or any(
                layer.weight.dtype != first.w1.weight.dtype or layer.weight.device != first.w1.weight.device
                for layer in layers
            )
        ):
            return None
        return shared

    def routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, always: int = 0) -> torch.Tensor:
        """`h` `[T, W]` -> `sum_k weights[:, k] E_{ids[:, k]}(h)` `[T, W]`. Few pairs with stacked experts: one GEMV
        per (token, expert) pair; more: blocks per expert over the stacked weights (stacked MXFP4 experts widened to
        the compute dtype for the call); experts not stacked: grouped GEMMs. `always`: the last that many slots are
        always-on experts stacked after the routed ones (see `stack_experts`)."""
        swiglu = self.config.hidden_act != "situ"
        if self.stacked_mxfp4 is not None:
            if ids.numel() <= moe.MXFP4_DEVICE_ROUTING_MAX_PAIRS:
                return moe.per_pair_mxfp4(
                    h, weights, ids, self.stacked_mxfp4, self.experts[0].w1.compute_dtype, self._activation, swiglu
                )
            # a prefill: every expert is likely picked, widen them all once
            up_gate, down = moe.widened_mxfp4(self.stacked_mxfp4, self.experts[0].w1.compute_dtype, h.shape[-1])
            return moe.stacked_blocks(h.to(up_gate.dtype), weights, ids, up_gate, down, self._activation, swiglu)
        if self.stacked is not None:
            if ids.numel() <= moe.DEVICE_ROUTING_MAX_PAIRS:
                return moe.per_pair(h, weights, ids, *self.stacked, self._activation, swiglu, always)
            return moe.stacked_blocks(h, weights, ids, *self.stacked, self._activation, swiglu)
        return moe.grouped_by_expert(h, weights, ids, list(self.experts), self._activation)

    def _always(self, tokens: int) -> int:
        """Always-on experts the router appends for a batch of `tokens`: the shared expert, when it rides in the
        stack as expert E (weight 1) for few tokens (see `stack_experts`)."""
        merged = self.shared_in_stack and tokens * self.config.num_experts_per_token <= moe.DEVICE_ROUTING_MAX_PAIRS
        return 1 if merged else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x, always=self._always(x.shape[0]))
        return self.from_routing(x, weights, ids).view(shape)

    def after_residual(
        self, h: torch.Tensor, delta: torch.Tensor, norm: K3RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(h + delta, self(norm(h + delta)))` with the residual update, the norm and the router as one op
        (`K3Router.after_residual`): a decode step's MoE layer starts with one kernel instead of three."""
        shape, width = h.shape, h.shape[-1]
        total, normed, weights, ids = self.gate.after_residual(
            h.reshape(-1, width), delta.reshape(-1, width), norm, always=self._always(h.numel() // width)
        )
        return total.view(shape), self.from_routing(normed, weights, ids).view(shape)

    def from_routing(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The layer's output for `x` `[T, D]` routed to `ids` with `weights` (the router's output for x)."""
        always = self._always(x.shape[0])
        if always:  # the shared expert is in the routing, as expert E
            return self.routed(x, weights, ids, always)
        shared_both = self._shared_up_gate(x)
        if self.config.routed_expert_hidden_size:
            y = self.routed(self.routed_expert_down_proj(x), weights, ids)
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x, weights, ids)
        if shared_both is not None:  # the shared expert's SwiGLU and down, plus the routed output, in one op
            zeros, ones = (t[: x.shape[0]] for t in self.one_slot)
            return expert_swiglu_down(shared_both, self.shared_experts.down_proj.weight[None], zeros, ones, add=y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    def _shared_up_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a decode step of up to `MAX_ROWS` tokens with a shared expert not riding in the stack (MXFP4
        experts; see `stack_experts`): its fused [up; gate] projection `[T, 2I]`, computed before the routed
        experts (its weights need no routing, so they load while the router runs); else None."""
        shared = getattr(self, "shared_experts", None)
        if (
            self.one_slot is None
            or shared is None
            or shared.fused_in is None
            or x.shape[0] > MAX_ROWS
            or self.config.hidden_act == "situ"
        ):
            return None
        return rows_linear(x, shared.fused_in)


def quantize_experts_mxfp4(model: nn.Module) -> nn.Module:
    """Replace every routed expert's linears by `MXFP4Linear`s quantized from them (the format K3 checkpoints ship
    their experts in), where the model is; returns the model."""
    for expert in [m for m in model.modules() if isinstance(m, K3Expert)]:
        for name in ("w1", "w2", "w3"):
            setattr(expert, name, to_mxfp4(getattr(expert, name)))
    return model


class K3ResidualQuery(nn.Module):
    """An AttnRes pseudo-query `[1, D]` (stored like a linear weight)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))


def attn_res_mix(rows: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    """Block AttnRes read: `softmax_j(q · RMSNorm_γ(R_j))`-weighted sum of the raw rows `R_j` `[..., D]`, float32,
    returned in the rows' dtype."""
    stacked = torch.stack(rows).float()  # [J, ..., D]
    keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    probs = torch.softmax(keys @ query.float().reshape(-1), dim=0)
    return (probs[..., None] * stacked).sum(0).to(rows[0].dtype)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, index: int, linear: LinearFactory):
        super().__init__()
        self.attention_type = config.attention_types[index]
        if self.attention_type == "kda":
            self.self_attn = K3DeltaAttention(config, linear)
        else:
            self.self_attn = K3MLAttention(config, linear)
        if config.ffn_types[index] == "moe":
            self.mlp = K3MoE(config, linear)
        else:
            self.mlp = K3MLP(config, config.hidden_size, config.intermediate_size, linear)
        self.input_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.self_attention_res_proj = K3ResidualQuery(config.hidden_size)
            self.self_attention_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_res_proj = K3ResidualQuery(config.hidden_size)
            self.mlp_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention(self, x: torch.Tensor, cache: K3Cache | None, index: int) -> torch.Tensor:
        """The attention sub-layer's output for its (pre-norm) input `x` `[B, T, D]`; updates `cache`."""
        return self.attend(self.input_layernorm(x), cache, index)

    def attend(self, h: torch.Tensor, cache: K3Cache | None, index: int) -> torch.Tensor:
        """`attention` given the already normalised input `h`."""
        if cache is None:
            return self.self_attn(h)[0] if self.attention_type == "kda" else self.self_attn(h)
        if self.attention_type == "kda":
            out, cache.layers[index] = self.self_attn(h, cache.layers[index])
            return out
        if cache.layers[index] is None:
            cache.layers[index] = PagedLatentCache(
                h.shape[0], self.self_attn.rank + self.self_attn.rope, h.dtype, h.device, cache.page_size
            )
        return self.self_attn(h, cache.layers[index])

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))


class K3Model(nn.Module):
    """Embedding, decoder layers and the final norm; returns the final hidden states `[B, T, D]`."""

    def __init__(self, config: K3Config, linear: LinearFactory = dense_linear):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i, linear) for i in range(config.num_hidden_layers))
        self.norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.output_attn_res_proj = K3ResidualQuery(config.hidden_size)
            self.output_attn_res_norm = K3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, inputs_embeds: torch.Tensor, cache: K3Cache | None = None, pending: bool = False
    ) -> torch.Tensor | PendingNorm:
        """`inputs_embeds` `[B, T, D]` -> the final hidden states `[B, T, D]`; with `pending`, for a few tokens,
        the final norm may come back as a `PendingNorm` for the head's kernel to compute."""
        if not self.config.attn_res_block_size:
            out = self._residual_stream(inputs_embeds, cache)
            return out if pending else resolved(out)
        return self.norm(self._attn_res_stream(inputs_embeds, cache))

    def _residual_stream(self, embeds: torch.Tensor, cache: K3Cache | None) -> torch.Tensor | PendingNorm:
        """`h += attention(norm(h)); h += mlp(norm(h))` per layer, then the final norm; each residual add and the
        norm after it are one op, the rounding as in that order. For a few tokens (a decode step) that op is left
        to the kernel of the projection that reads it (`PendingNorm`); the MoE's router computes it itself."""
        defer = embeds.shape[0] * embeds.shape[1] <= MAX_ROWS

        def norm_after(h: torch.Tensor, delta: torch.Tensor | None, norm: K3RMSNorm) -> PendingNorm:
            pending = PendingNorm(h, delta, norm)
            if not defer:
                pending.value()
            return pending

        normed = norm_after(embeds, None, self.layers[0].input_layernorm)
        for index, layer in enumerate(self.layers):
            post = layer.post_attention_layernorm
            attended = layer.attend(normed if defer else normed.value(), cache, index)
            h = normed.total()
            if isinstance(layer.mlp, K3MoE):  # the add, the norm and the router: one kernel in decode steps
                h, out = layer.mlp.after_residual(h, attended, post)
            else:
                ffn_in = norm_after(h, attended, post)
                out = layer.mlp(ffn_in if defer else ffn_in.value())
                h = ffn_in.total()
            following = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else self.norm
            normed = norm_after(h, out, following)
        return normed if defer else normed.value()

    def _attn_res_stream(self, embeds: torch.Tensor, cache: K3Cache | None) -> torch.Tensor:
        """Block Attention Residuals. `bank` holds block snapshots; `prefix` is the sum of the sub-layer outputs
        since the current block began (the embedding at the start). Layer l's attention reads
        mix(bank + [prefix]); when l % block_size == 0 the prefix is then banked and restarted. The FFN reads
        mix(bank + [prefix + attention output]). The model's output reads mix(bank + [prefix])."""
        eps, block = self.config.rms_norm_eps, self.config.attn_res_block_size
        bank, prefix = [], embeds
        for index, layer in enumerate(self.layers):
            x = attn_res_mix(
                bank + [prefix], layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight, eps
            )
            if index % block == 0:
                bank, prefix = bank + [prefix], None
            out = layer.attention(x, cache, index)
            prefix = out if prefix is None else prefix + out
            x = attn_res_mix(bank + [prefix], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
            prefix = prefix + layer.feed_forward(x)
        return attn_res_mix(bank + [prefix], self.output_attn_res_proj.weight, self.output_attn_res_norm.weight, eps)


class K3ForCausalLM(nn.Module):
    """The text model plus `lm_head`; with a `vision_config`, also the vision tower and projector whose outputs
    replace the embeddings at `<|media_pad|>` positions."""

    # Kept float32 whatever the working dtype (K3 stores and uses them so).
    keep_fp32_modules = ("A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "gate")

    def __init__(self, config: K3Config, linear: LinearFactory = dense_linear):
        super().__init__()
        self.config = config
        self.model = K3Model(config, linear)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.vision_config is not None:
            vision = K3VisionConfig.from_dict(config.vision_config, config.hidden_size)
            self.vision_tower = K3VisionTower(vision, linear)
            self.mm_projector = K3MultiModalProjector(vision, linear)

    @classmethod
    def from_pretrained(
        cls, folder, torch_dtype: torch.dtype = torch.bfloat16, device=None, linear_factory: LinearFactory | None = None
    ) -> "K3ForCausalLM":
        """Load a K3 or Kimi-Linear checkpoint folder (see `h3gen.pipelines.k3.loader`)."""
        return load_k3(cls, folder, torch_dtype=torch_dtype, device=device, linear_factory=linear_factory)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` `[B, T]` -> `[B, T, D]`: the embedding rows (a decode step's few ids by the kernel that lets
        the first projection start while it copies, `kernels.embedding`)."""
        table = self.model.embed_tokens
        if type(table) is nn.Embedding and table.padding_idx is None and table.max_norm is None:
            return embedding_rows(input_ids, table.weight)
        return table(input_ids)

    def encode_images(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """Vision tower + projector: `pixel_values` `[Np, 3, p, p]` and `grid_thws` `[n, 3]` (from
        `K3ImageProcessor`) -> `[sum of the images' token counts, D]`, images in order."""
        if not hasattr(self, "vision_tower"):
            raise ValueError("this checkpoint has no vision tower (no vision_config); images cannot be used.")
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def embed_multimodal(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        grid_thws=None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings `[B, T, D]` with the image embeddings (given, or encoded from `pixel_values`) written
        over the `<|media_pad|>` positions, in order (row-major over the batch)."""
        embeds = self.embed(input_ids)
        if image_embeds is None and pixel_values is None:
            return embeds
        if image_embeds is None:
            image_embeds = self.encode_images(pixel_values, grid_thws)
        mask = input_ids == self.config.media_placeholder_token_id
        count = int(mask.sum())
        if count != image_embeds.shape[0]:
            raise ValueError(
                f"the prompt has {count} <|media_pad|> tokens but the images give {image_embeds.shape[0]} "
                "embeddings (expand each image's placeholder to its token count)."
            )
        embeds = embeds.clone()
        embeds[mask] = image_embeds.to(embeds.dtype)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws=None,
        with_argmax: bool = False,
        argmax_into: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` `[B, T]` (or `inputs_embeds` `[B, T, D]`) -> logits `[B, T, vocab]`. With `cache`, continues
        from the state it holds (prefill chunk or one-token decode) and leaves it updated. With `pixel_values` /
        `grid_thws` (see `encode_images`), the image embeddings replace the `<|media_pad|>` embeddings. With
        `with_argmax`, returns (logits, their argmax `[B, T]` int64: the greedy tokens, found by the head's kernel
        in a decode step); with `argmax_into` (contiguous int64, `B * T` of them) too, the argmax written there
        (a decode graph puts it where its next step reads its token ids)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_multimodal(input_ids, pixel_values, grid_thws)
        hidden = self.model(inputs_embeds, cache, pending=True)  # the final norm in the head's kernel
        if cache is not None:
            cache.seen_tokens += inputs_embeds.shape[1]
        if with_argmax or argmax_into is not None:
            return project_argmax(self.lm_head, hidden, argmax_into)
        return project(self.lm_head, hidden)

    def new_cache(self, page_size: int = 16) -> K3Cache:
        return K3Cache(self.config.num_hidden_layers, page_size)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        inputs_embeds: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws=None,
    ) -> torch.Tensor:
        """Greedy decoding: one prefill (images spliced in when given), then one token per step with the cache.
        Returns `[B, new]` token ids."""
        cache = self.new_cache()
        logits = self(input_ids, cache, inputs_embeds=inputs_embeds, pixel_values=pixel_values, grid_thws=grid_thws)[
            :, -1
        ]
        tokens = []
        for _ in range(max_new_tokens):
            token = logits.argmax(-1)
            tokens.append(token)
            if eos_token_id is not None and bool((token == eos_token_id).all()):
                break
            logits = self(token[:, None], cache)[:, -1]
        return torch.stack(tokens, dim=1)
