"""Kimi Delta Attention (KDA) ops: `short_conv`, `kda_gate`, `kda_recurrent` (decode) and `kda_chunked` (prefill).

Only the torch reference exists so far; every function takes it on every device. fla-core's Triton kernels
(`fla.ops.kda.chunk_kda` / `fused_recurrent_kda`) compute the same thing on CUDA and are the planned fast path.
"""

from h3gen.kernels.kda.reference import kda_chunked, kda_gate, kda_recurrent, short_conv

__all__ = ["kda_chunked", "kda_gate", "kda_recurrent", "short_conv"]
