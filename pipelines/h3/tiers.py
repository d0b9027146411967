"""Quality tiers of the H3 transformer.

- `exact`: the reference op order (bit-identical to diffusers on the same backend).
- `lossless` (default): the same math with fused kernels (`h3gen.kernels`): one pass for RMSNorm + modulation,
  q/k norm + RoPE, SwiGLU, and the gated residual fused with the next norm; bf16-level differences only.
- `fast`: `lossless` plus FP8 (e4m3) GEMMs for the block's q/k/v/out and SwiGLU projections, per-row activation and
  per-column weight scales (`h3gen.quant.fp8`, layers made by `h3gen.linear.to_fp8`), and FP8 attention where
  FlashAttention-3 is installed (sparse attention too then: VSA-H3's kernel over e4m3 key and value tiles, see
  `h3gen.kernels.vsa_h3`); the fused row kernels write their results in e4m3 directly, so no activation is
  quantized by a pass of its own except the attention output and v. An approximation with measured error; the
  weights are quantized in place, so a model set to `fast` cannot go back. Tensor-parallel blocks quantize each
  rank's shard (the collectives stay); blocks whose GEMMs are MXFP4 (`--quantization mxfp4`) keep them, so there
  `fast` is `lossless` with FP8 attention.
- `high` / `fast+high`: `lossless` / `fast` plus the first-block step cache, attached per request
  (`step_cache.py`); the blocks are set exactly as for their base tier.
"""

import torch

from h3gen.kernels.attention import fa3_available, fp8_attention, takes_fp8_inputs
from h3gen.kernels.attention_core import AttentionCore
from h3gen.kernels.fp8_quant import quantize_heads, quantize_rows
from h3gen.kernels.gated_residual import gated_residual, gated_residual_norm_modulate
from h3gen.kernels.norm_modulate import rmsnorm_modulate
from h3gen.kernels.qk_norm_rope import qk_norm_rope
from h3gen.kernels.swiglu import swiglu
from h3gen.linear import to_fp8
from h3gen.lora import wide_input
from h3gen.options import QUALITY_TIERS, base_tier, check_choice


def fused_block_forward(
    block,
    hidden_states: torch.Tensor,
    table: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`H3TransformerBlock.forward` through fused kernels, given the block's `(K * 3, 6 * hidden)` AdaLN table:
    5 passes over the rows besides GEMMs and attention. Where a linear carries a K-extended LoRA
    (`h3gen.lora.wide`), the kernel producing its input writes it where the LoRA's GEMM reads it (`wide_input`).
    The residual stream is updated in place."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.chunk(6, dim=-1)
    attn, rows, device = block.attn, hidden_states.shape, hidden_states.device
    normed = rmsnorm_modulate(
        hidden_states,
        block.norm1.weight,
        shift_msa,
        scale_msa,
        adaln_indices,
        block.norm1.eps,
        out=wide_input(attn.to_q, rows, device),
    )
    query = attn.to_q(normed).unflatten(-1, (-1, attn.head_dim))
    key = attn.to_k(normed).unflatten(-1, (-1, attn.head_dim))
    value = attn.to_v(normed).unflatten(-1, (-1, attn.head_dim))
    query, key = qk_norm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, *rotary_emb, attn.norm_q.eps)
    out = attn.to_out[0](attn.core(query, key, value, attn.gate(normed)).flatten(2, 3))
    hidden_states, normed = gated_residual_norm_modulate(
        hidden_states,
        out,
        gate_msa,
        adaln_indices,
        block.norm2.weight,
        shift_mlp,
        scale_mlp,
        block.norm2.eps,
        out=hidden_states,
        normed_out=wide_input(block.ff.net[0].proj, rows, device),
    )
    up = block.ff.net[0].proj(normed)
    ff = block.ff.net[2](swiglu(up, out=wide_input(block.ff.net[2], (*up.shape[:-1], up.shape[-1] // 2), device)))
    return gated_residual(hidden_states, ff, gate_mlp, adaln_indices, out=hidden_states)


def fast_block_forward(
    block,
    hidden_states: torch.Tensor,
    table: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """`fused_block_forward` for a block whose GEMMs are `Fp8Linear`s: the norms and SwiGLU hand e4m3 rows with
    their scales straight to the GEMMs and, when the attention backend takes FP8 inputs (FlashAttention-3's),
    q/k norm + RoPE hands e4m3 heads straight to attention. Where a GEMM carries a K-extended LoRA
    (`h3gen.lora.wide`), the kernel producing its input writes the e4m3 rows where the LoRA's GEMM reads them
    (`wide_input`). The residual stream is updated in place."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.chunk(6, dim=-1)
    attn, rows, device = block.attn, hidden_states.shape, hidden_states.device
    normed = rmsnorm_modulate(
        hidden_states,
        block.norm1.weight,
        shift_msa,
        scale_msa,
        adaln_indices,
        block.norm1.eps,
        fp8=True,
        out=wide_input(attn.to_q, rows, device),
    )
    query = attn.to_q(normed).unflatten(-1, (-1, attn.head_dim))
    key = attn.to_k(normed).unflatten(-1, (-1, attn.head_dim))
    value = attn.to_v(normed).unflatten(-1, (-1, attn.head_dim))
    rope_args = (attn.norm_q.weight, attn.norm_k.weight, *rotary_emb, attn.norm_q.eps)
    # A sequence-parallel core exchanges bf16 heads between ranks, and VSA-H3 selects its tiles from bf16 heads (and
    # quantizes its own key and value tiles under "fa3-fp8"): only the plain dense core takes e4m3 directly.
    plain = type(attn.core) is AttentionCore and attn.core.plan is None
    if plain and takes_fp8_inputs(attn.core.backend):
        query, key = qk_norm_rope(query, key, *rope_args, fp8=True)
        out = fp8_attention(query, key, quantize_heads(value), out_dtype=hidden_states.dtype)
    else:
        gate = None
        if attn.to_gate_compress is not None:  # a VSA student's gate (bf16 weights) reads the e4m3 rows dequantized
            gate = attn.gate(normed.values.float().mul(normed.scale.view(*rows[:-1], 1)).to(hidden_states.dtype))
        out = attn.core(*qk_norm_rope(query, key, *rope_args), value, gate)
    out = out.flatten(2, 3)
    wide = wide_input(attn.to_out[0], out.shape, device)
    out = attn.to_out[0](out if wide is None else quantize_rows(out, out=wide))
    hidden_states, normed = gated_residual_norm_modulate(
        hidden_states,
        out,
        gate_msa,
        adaln_indices,
        block.norm2.weight,
        shift_mlp,
        scale_mlp,
        block.norm2.eps,
        out=hidden_states,
        fp8=True,
        normed_out=wide_input(block.ff.net[0].proj, rows, device),
    )
    up = block.ff.net[0].proj(normed)
    ff = block.ff.net[2](
        swiglu(up, fp8=True, out=wide_input(block.ff.net[2], (*up.shape[:-1], up.shape[-1] // 2), device))
    )
    return gated_residual(hidden_states, ff, gate_mlp, adaln_indices, out=hidden_states)


def quantize_block_linears(block) -> bool:
    """Turn a transformer block's q/k/v/out and SwiGLU projections to FP8 where they are dense (plain or tensor
    parallel) linears; AdaLN stays as it is (it runs on 2-4 rows and is 0 % of the FLOPs). Returns whether every
    one of them now takes e4m3 rows (`Fp8Rows`); MXFP4 projections stay MXFP4 and take bf16 rows."""
    attn, ff = block.attn, block.ff
    slots = [(attn, name) for name in ("to_q", "to_k", "to_v")] + [(attn.to_out, 0), (ff.net[0], "proj"), (ff.net, 2)]
    all_fp8 = True
    for owner, key in slots:
        layer = owner[key] if isinstance(key, int) else getattr(owner, key)
        quantized = to_fp8(layer)
        if quantized is None:
            all_fp8 = False
        elif isinstance(key, int):
            owner[key] = quantized
        else:
            setattr(owner, key, quantized)
    return all_fp8


def set_quality(transformer, tier: str, attention: str | None = None) -> None:
    """Switch `transformer` (an `H3Transformer`) to a quality tier. `exact` <-> `lossless` is free and reversible;
    `fast` quantizes the block GEMM weights to FP8 in place. `attention` (a backend name, see `RunOptions`) replaces
    the tier's own attention backend. `high` and `fast+high` set their base tier (lossless, fast): their step
    cache is attached per request (`step_cache.py`)."""
    check_choice("quality", tier, QUALITY_TIERS)
    tier = base_tier(tier)
    if getattr(transformer, "quality", None) == "fast" and tier != "fast":
        raise ValueError("this transformer's weights were quantized for the fast tier; reload it for another tier.")
    # exact: torch's own SDPA choice, as diffusers; lossless: the fastest exact backend of the device (FA3 when
    # installed, else cuDNN on Hopper); fast: FA3's FP8 attention when installed.
    own = {"exact": "sdpa", "lossless": "auto", "fast": "fa3-fp8" if fa3_available() else "auto"}[tier]
    backend = attention or own
    forward = {"exact": None, "lossless": fused_block_forward, "fast": fast_block_forward}[tier]
    for block in transformer.transformer_blocks:
        block.fused_forward = forward
        block.attn.core.backend = backend
    if tier == "fast" and getattr(transformer, "quality", None) != "fast":
        for block in transformer.transformer_blocks:
            block.fp8_gemms = quantize_block_linears(block)
    if tier == "fast":
        for block in transformer.transformer_blocks:
            if not getattr(block, "fp8_gemms", True):  # MXFP4 GEMMs take bf16 rows: FP8 attention only
                block.fused_forward = fused_block_forward
    transformer.quality = tier
