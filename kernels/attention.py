"""One attention dispatch for every model in h3gen.

`attention(query, key, value)` computes full (bidirectional, unmasked) softmax attention over one packed sequence.
Backends are torch SDPA implementations; "sdpa" lets torch choose, which is exactly what diffusers' native backend
does, so it is the reference. An explicit backend can be passed per call or set for the process with the
`H3GEN_ATTENTION_BACKEND` environment variable.
"""

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
BACKENDS = ("sdpa", *_SDPA_BACKENDS)


def available_attention_backends() -> tuple[str, ...]:
    """Names accepted by `attention(..., backend=...)` and `H3GEN_ATTENTION_BACKEND`."""
    return BACKENDS


def _resolve_backend(backend: str | None) -> str:
    name = backend or os.environ.get("H3GEN_ATTENTION_BACKEND") or "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    return name


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """Softmax attention of every row over every row, scale 1/sqrt(head_dim).

    Args:
        query, key, value: `(batch, seq_len, heads, head_dim)`, one dtype (fp32, fp16 or bf16), same device.
        backend: one of `available_attention_backends()`; default from `H3GEN_ATTENTION_BACKEND`, else "sdpa".

    Returns:
        `(batch, seq_len, heads, head_dim)` in the input dtype.
    """
    if query.ndim != 4 or query.shape != key.shape or key.shape != value.shape:
        raise ValueError(
            "attention expects query, key and value of one (batch, seq_len, heads, head_dim) shape, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    name = _resolve_backend(backend)
    context = sdpa_kernel(_SDPA_BACKENDS[name]) if name in _SDPA_BACKENDS else nullcontext()
    query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    with context:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3)
