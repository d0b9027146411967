"""Kimi Delta Attention (KDA) ops: `short_conv`, `kda_gate`, `l2_normalize`, `kda_recurrent` (token by token),
`kda_chunked` (prefill) and `kda_decode` (one token of a layer after its projections, states updated in place).

`kda_decode` runs its fused Triton kernel on CUDA, the composed torch reference elsewhere; the others are torch on
every device. fla-core's Triton kernels (`fla.ops.kda.chunk_kda`) compute the chunked form on CUDA and are the
planned fast path for prefill.
"""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.kda import reference
from h3gen.kernels.kda.reference import kda_chunked, kda_gate, kda_recurrent, l2_normalize, short_conv


def kda_decode(q, k, v, conv_weights, conv_state, f, a_log, dt_bias, lower_bound, b, gate, norm_weight, norm_eps,
               state, scale):
    """One decode token of a KDA layer (see `reference.kda_decode`); `conv_state` and `state` change in place."""
    if use_triton(q) and state.stride(3) == 1 and state.stride(2) == state.shape[3] and conv_state.stride(2) == 1:
        from h3gen.kernels.kda import triton as fast

        return fast.kda_decode(q, k, v, conv_weights, conv_state, f, a_log, dt_bias, lower_bound, b, gate,
                               norm_weight, norm_eps, state, scale)
    return reference.kda_decode(q, k, v, conv_weights, conv_state, f, a_log, dt_bias, lower_bound, b, gate,
                                norm_weight, norm_eps, state, scale)


__all__ = ["kda_chunked", "kda_decode", "kda_gate", "kda_recurrent", "l2_normalize", "short_conv"]
