"""The K3 text-model configuration, read from a checkpoint's `config.json`.

Two spellings are accepted: a K3 folder (`model_type="kimi_k3"`, text fields under `text_config`, plus
`vision_config`) and a Kimi-Linear folder (`model_type="kimi_linear"`, as written by the original release or by
transformers' `save_pretrained`, which adds its own aliases such as `num_local_experts` and `layer_types`).
"""

from dataclasses import dataclass, field

from h3gen.errors import CheckpointError

_MISSING = object()


def _pick(data: dict, names: tuple[str, ...], default=_MISSING):
    for name in names:
        if data.get(name) is not None:
            return data[name]
    if default is _MISSING:
        raise CheckpointError(f"config.json has none of {', '.join(names)}.")
    return default


@dataclass
class K3Config:
    """Text backbone of K3 / Kimi-Linear. Layer lists are 0-indexed here (the checkpoint's are 1-indexed)."""

    model_type: str = "kimi_k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Per layer: "kda" (Kimi Delta Attention) or "mla" (gated MLA); "dense" or "moe" FFN.
    attention_types: list[str] = field(default_factory=list)
    ffn_types: list[str] = field(default_factory=list)
    # MLA
    num_attention_heads: int = 96
    q_lora_rank: int | None = None  # None: one full-rank q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the shared key part; K3's MLA applies no rotary embedding (NoPE)
    v_head_dim: int = 128
    mla_use_output_gate: bool = False  # K3: o = attn ⊙ sigmoid(g_proj x) before o_proj
    mla_norm_eps: float = 1e-6  # eps of q_a_layernorm / kv_a_layernorm
    # KDA
    linear_num_heads: int = 96
    linear_head_dim: int = 128
    conv_kernel_size: int = 4
    use_full_rank_gate: bool = False  # K3: one g_proj; Kimi-Linear: low-rank g_a_proj / g_b_proj
    gate_lower_bound: float | None = None  # K3: -5.0 ("safe gate"); None: -exp(A_log) softplus(.) decay
    linear_norm_eps: float = 1e-5  # eps of the per-head output RMSNorm
    # FFN / MoE
    hidden_act: str = "silu"  # "silu" or "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 11008  # dense layers
    moe_intermediate_size: int = 3072  # per routed expert
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 0
    routed_expert_hidden_size: int | None = None  # LatentMoE width; None = experts at full width
    latent_moe_use_norm: bool = False
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    # Block Attention Residuals; None = the plain residual stream
    attn_res_block_size: int | None = None
    # Routed experts stored as MXFP4 (weight_packed / weight_scale)
    experts_mxfp4: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # K3 outer config
    media_placeholder_token_id: int | None = None
    vision_config: dict | None = None

    @property
    def mla_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, data: dict) -> "K3Config":
        model_type = data.get("model_type")
        outer = {}
        if model_type == "kimi_k3":
            outer, data = data, data.get("text_config")
            if not isinstance(data, dict):
                raise CheckpointError("a kimi_k3 config.json needs a text_config object.")
        elif model_type != "kimi_linear":
            raise CheckpointError(f"config.json model_type is {model_type!r}; expected 'kimi_k3' or 'kimi_linear'.")
        layers = int(_pick(data, ("num_hidden_layers",)))
        linear = data.get("linear_attn_config") or {}
        quant = data.get("quantization_config") or outer.get("quantization_config") or {}
        act = _pick(data, ("hidden_act",), "silu")
        if act not in ("silu", "situ"):
            raise CheckpointError(f"hidden_act {act!r} is not supported; expected 'silu' or 'situ'.")
        config = cls(
            model_type="kimi_k3" if outer else "kimi_linear",
            vocab_size=int(_pick(data, ("vocab_size",))),
            hidden_size=int(_pick(data, ("hidden_size",))),
            num_hidden_layers=layers,
            rms_norm_eps=float(_pick(data, ("rms_norm_eps",), 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_types=_attention_types(data, linear, layers),
            ffn_types=_ffn_types(data, layers),
            num_attention_heads=int(_pick(data, ("num_attention_heads",))),
            q_lora_rank=_pick(data, ("q_lora_rank",), None),
            kv_lora_rank=int(_pick(data, ("kv_lora_rank",), 512)),
            qk_nope_head_dim=int(_pick(data, ("qk_nope_head_dim",), 128)),
            qk_rope_head_dim=int(_pick(data, ("qk_rope_head_dim",), 64)),
            v_head_dim=int(_pick(data, ("v_head_dim",), 128)),
            mla_use_output_gate=bool(data.get("mla_use_output_gate", False)),
            # transformers' KimiLinearAttention uses its RMSNorm default 1e-6; sglang's MLA uses rms_norm_eps.
            mla_norm_eps=float(_pick(data, ("rms_norm_eps",), 1e-6)) if outer else 1e-6,
            linear_num_heads=int(_pick(linear, ("num_heads",), None) or _pick(data, ("linear_num_heads",), 32)),
            linear_head_dim=int(_pick(linear, ("head_dim",), None) or _pick(data, ("linear_head_dim",), 128)),
            conv_kernel_size=int(
                _pick(linear, ("short_conv_kernel_size",), None) or _pick(data, ("linear_conv_kernel_dim",), 4)
            ),
            use_full_rank_gate=bool(linear.get("use_full_rank_gate", False)),
            gate_lower_bound=linear.get("gate_lower_bound", data.get("gate_lower_bound")),
            # transformers builds the KDA output norm with rms_norm_eps; sglang builds K3's with its 1e-5 default.
            linear_norm_eps=1e-5 if outer else float(_pick(data, ("rms_norm_eps",), 1e-5)),
            hidden_act=act,
            situ_beta=float(_pick(data, ("activation_situ_beta",), 4.0)),
            situ_linear_beta=float(_pick(data, ("activation_situ_linear_beta",), 25.0)),
            intermediate_size=int(_pick(data, ("intermediate_size",), 11008)),
            moe_intermediate_size=int(_pick(data, ("moe_intermediate_size",), 0)),
            num_experts=int(_pick(data, ("num_experts", "num_local_experts", "n_routed_experts"), 0)),
            num_experts_per_token=int(_pick(data, ("num_experts_per_token", "num_experts_per_tok"), 1)),
            num_shared_experts=int(_pick(data, ("num_shared_experts", "n_shared_experts"), 0)),
            routed_expert_hidden_size=_pick(data, ("routed_expert_hidden_size",), None),
            latent_moe_use_norm=bool(data.get("latent_moe_use_norm", False)),
            num_expert_group=int(_pick(data, ("num_expert_group", "n_group"), 1)),
            topk_group=int(_pick(data, ("topk_group",), 1)),
            routed_scaling_factor=float(_pick(data, ("routed_scaling_factor",), 1.0)),
            moe_renormalize=bool(_pick(data, ("moe_renormalize", "norm_topk_prob"), True)),
            attn_res_block_size=_pick(data, ("attn_res_block_size",), None),
            experts_mxfp4=_is_mxfp4(quant),
            bos_token_id=_pick(data, ("bos_token_id",), None),
            eos_token_id=_pick(data, ("eos_token_id",), None),
            pad_token_id=_pick(data, ("pad_token_id",), None),
            media_placeholder_token_id=outer.get("media_placeholder_token_id"),
            vision_config=outer.get("vision_config"),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if "moe" in self.ffn_types and (self.num_experts <= 0 or self.moe_intermediate_size <= 0):
            raise CheckpointError("MoE layers need num_experts > 0 and moe_intermediate_size > 0.")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"num_experts_per_token must be in [1, {self.num_experts}] (got {self.num_experts_per_token})."
            )
        if self.num_experts and self.num_experts % self.num_expert_group:
            raise CheckpointError(
                f"num_experts {self.num_experts} is not a multiple of num_expert_group {self.num_expert_group}."
            )
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise CheckpointError(f"attn_res_block_size must be >= 1 (got {self.attn_res_block_size}).")


def _attention_types(data: dict, linear: dict, layers: int) -> list[str]:
    if "kda_layers" in linear or "full_attn_layers" in linear:
        kda, mla = set(linear.get("kda_layers") or ()), set(linear.get("full_attn_layers") or ())
        bad = sorted(i for i in kda | mla if not 1 <= i <= layers)
        if bad or kda & mla or len(kda | mla) != layers:
            raise CheckpointError(
                f"linear_attn_config kda_layers / full_attn_layers must split layers 1..{layers} (1-indexed) between "
                f"them, each layer once (out of range: {bad}, in both: {sorted(kda & mla)})."
            )
        return ["kda" if i + 1 in kda else "mla" for i in range(layers)]
    if data.get("layer_types"):
        names = {"linear_attention": "kda", "full_attention": "mla"}
        types = [names.get(t) for t in data["layer_types"]]
        if len(types) != layers or None in types:
            raise CheckpointError(f"layer_types must list {layers} of 'linear_attention' / 'full_attention'.")
        return types
    # transformers' KimiLinearConfig default
    return ["mla" if i and i % 4 == 0 else "kda" for i in range(layers)]


def _ffn_types(data: dict, layers: int) -> list[str]:
    if data.get("mlp_layer_types"):
        types = ["moe" if t == "sparse" else "dense" for t in data["mlp_layer_types"]]
        if len(types) != layers:
            raise CheckpointError(f"mlp_layer_types must list {layers} entries.")
        return types
    first_dense = int(data.get("first_k_dense_replace", 1 if data.get("model_type") == "kimi_linear" else 0))
    freq = int(data.get("moe_layer_freq", 1))
    has_experts = _pick(data, ("num_experts", "num_local_experts", "n_routed_experts"), None)
    return ["moe" if has_experts and i >= first_dense and i % freq == 0 else "dense" for i in range(layers)]


def _is_mxfp4(quant: dict) -> bool:
    if quant.get("quant_method") == "mxfp4":
        return True
    groups = quant.get("config_groups") or {}
    return (
        any("mxfp4" in str((group or {}).get("format", "")).lower() for group in groups.values())
        or "mxfp4" in str(quant.get("format", "")).lower()
    )
