"""Kimi Delta Attention (KDA) ops: `short_conv`, `kda_gate`, `l2_normalize`, `kda_recurrent` (token by token),
`kda_chunked` (prefill) and `kda_decode` (one token of a layer after its projections, states updated in place).

`kda_decode` runs its fused Triton kernel on CUDA (convs of 2-4 taps), the composed torch reference elsewhere;
`kda_chunked` runs fla-core's Triton chunk kernel (`fla.ops.kda.chunk_kda`) on CUDA when asked (`H3GEN_FLA=1`) and
installed; the others are torch on every device.
"""

import os

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.kda import reference
from h3gen.kernels.kda.reference import kda_gate, kda_recurrent, l2_normalize, short_conv

_FLA_CHUNK = None  # fla's chunk_kda once looked up; False when fla-core is not installed or does not import


def _fla_chunk_kda():
    global _FLA_CHUNK
    if _FLA_CHUNK is None:
        try:
            from fla.ops.kda import chunk_kda
        except Exception:  # not installed, or not importable with this torch / triton
            chunk_kda = False
        _FLA_CHUNK = chunk_kda
    return _FLA_CHUNK or None


def kda_chunked(q, k, v, g, beta, scale, initial_state=None, chunk_size: int = 64):
    """The chunked recurrence (see `reference.kda_chunked`). Returns (`o` `[B, T, H, V]` in v.dtype, final state
    float32). With `H3GEN_FLA=1` on CUDA and fla-core installed (`pip install h3gen[k3]`), fla's Triton chunk kernel (3x
    the prefill speed on the H200; its first call autotunes for about a minute; opt-in until its agreement with the
    reference is measured on a GPU); else the torch reference."""
    wanted = os.environ.get("H3GEN_FLA") == "1" and q.is_cuda and use_triton(q) and q.shape[1] > 0
    fla = _fla_chunk_kda() if wanted else None
    if fla is not None:
        state = None if initial_state is None else initial_state.float().contiguous()
        o, final = fla(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True)
        return o.to(v.dtype), final.float()
    return reference.kda_chunked(q, k, v, g, beta, scale, initial_state, chunk_size)


def kda_decode(
    q,
    k,
    v,
    conv_weights,
    conv_state,
    f,
    a_log,
    dt_bias,
    lower_bound,
    b,
    gate,
    norm_weight,
    norm_eps,
    state,
    scale,
    rows=None,
    gate_up=None,
):
    """One decode token of a KDA layer (see `reference.kda_decode`); `conv_state` and `state` change in place (with
    `rows`, the rows of them the sequences own). With `gate_up` (`[2, H * D, R]`), `f` and `gate` are the low-rank
    gate inputs, projected up inside the op."""
    if (
        use_triton(q)
        and state.stride(3) == 1
        and state.stride(2) == state.shape[3]
        and conv_state.stride(2) == 1
        and conv_weights[0].shape[-1] <= 4
    ):
        from h3gen.kernels.kda import triton as fast  # on first use: see _dispatch

        return fast.kda_decode(
            q,
            k,
            v,
            conv_weights,
            conv_state,
            f,
            a_log,
            dt_bias,
            lower_bound,
            b,
            gate,
            norm_weight,
            norm_eps,
            state,
            scale,
            rows=rows,
            gate_up=gate_up,
        )
    return reference.kda_decode(
        q,
        k,
        v,
        conv_weights,
        conv_state,
        f,
        a_log,
        dt_bias,
        lower_bound,
        b,
        gate,
        norm_weight,
        norm_eps,
        state,
        scale,
        rows,
        gate_up,
    )


__all__ = ["kda_chunked", "kda_decode", "kda_gate", "kda_recurrent", "l2_normalize", "short_conv"]
