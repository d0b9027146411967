"""One attention dispatch for every model in h3gen.

`attention(query, key, value)` computes full (bidirectional, unmasked) softmax attention over one packed sequence.

Backends: "sdpa" lets torch choose (what diffusers' native backend does, so the `exact` tier uses it); "cudnn",
"flash", "efficient", "math" pin one torch SDPA implementation; "fa3" is FlashAttention-3 when its
`flash_attn_interface` (or the forward-only `fa3_fwd_interface`) module is importable, "fa3-fp8" the same with q,
k and v quantized to e4m3 per (batch, head) (an approximation, for the `fast` tier). "auto" picks the fastest
available for the device and the inputs: FA3 for bf16 heads (the `fa3-fwd` build has no fp16), else cuDNN on Hopper
and newer, else flash; for float32 (which FA3, cuDNN and flash do not take) or head sizes they do not take, torch's
choice. `H3GEN_ATTENTION_BACKEND` overrides every call's choice.
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3gen.kernels.attention_backends import BACKENDS, SDPA_BACKEND_NAMES
from h3gen.kernels.fp8_quant import quantize_heads

_SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
assert tuple(_SDPA_BACKENDS) == SDPA_BACKEND_NAMES
LAYOUTS = ("bshd", "bhsd")


def available_attention_backends() -> tuple[str, ...]:
    """Names accepted by `attention(..., backend=...)` and `H3GEN_ATTENTION_BACKEND`."""
    return BACKENDS


@functools.cache
def fa3_kernel():
    """FlashAttention-3's `flash_attn_func`, or None where it is not installed."""
    # FlashAttention-3's own module name, or the forward-only build's (`fa3-fwd` on PyPI).
    for module in ("flash_attn_interface", "fa3_fwd_interface"):
        try:
            return __import__(module).flash_attn_func
        except (ImportError, AttributeError, OSError):
            continue
    return None


# The backends that take only fp16/bf16 inputs, and the largest head size each takes (a multiple of 8).
_HALF_ONLY = {"fa3": 256, "cudnn": 128, "flash": 256}
_HALF = (torch.float16, torch.bfloat16)


def _auto_backend(
    device_type: str, major: int, dtype: torch.dtype, head_dim: int, has_fa3: bool, has_cudnn: bool
) -> str:
    """The fastest backend for these inputs: FA3 on Hopper (bf16), else cuDNN on Hopper and newer, else flash on
    Ampere and newer, each only where it takes the dtype and head size; else torch's own choice ("sdpa")."""
    if device_type != "cuda" or not _takes(dtype, head_dim, 256):
        return "sdpa"
    if major == 9 and has_fa3 and dtype == torch.bfloat16:  # `fa3-fwd` wheels are built without fp16
        return "fa3"
    if major >= 9 and has_cudnn and _takes(dtype, head_dim, _HALF_ONLY["cudnn"]):
        return "cudnn"
    return "flash" if major >= 8 else "sdpa"


def _takes(dtype: torch.dtype, head_dim: int, largest: int) -> bool:
    return dtype in _HALF and head_dim % 8 == 0 and head_dim <= largest


def fa3_available() -> bool:
    """True when a FlashAttention-3 module is importable (`pip install fa3-fwd` on Hopper)."""
    return fa3_kernel() is not None


def _fa3_fp8(query, key, value):
    return fp8_attention(*(quantize_heads(t) for t in (query, key, value)), out_dtype=query.dtype)


def fp8_attention(
    query: tuple[torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
    value: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Attention over inputs already in e4m3 (the `fast` tier hands them over from its fused kernels).

    Args:
        query, key, value: each `(values, descale)`: `(B, S, H, D)` e4m3 and `(B, H)` float32, the input being
            `values * descale` (FlashAttention-3's FP8 contract).
        out_dtype: the output dtype (FlashAttention-3 writes bf16).
    Returns:
        `(B, S, H, D)` in `out_dtype`: FlashAttention-3 on a CUDA device where it is installed; elsewhere the
        dequantized inputs through torch's SDPA in float32 (the reference, how tests run this path on the CPU).
    """
    (q, sq), (k, sk), (v, sv) = query, key, value
    if q.is_cuda and fa3_kernel() is not None:
        out = fa3_kernel()(q, k, v, causal=False, q_descale=sq, k_descale=sk, v_descale=sv)
        out = out[0] if isinstance(out, tuple) else out
        return out.to(out_dtype)
    dense = [(t.float() * s[:, None, :, None]).transpose(1, 2) for t, s in ((q, sq), (k, sk), (v, sv))]
    return F.scaled_dot_product_attention(*dense).transpose(1, 2).to(out_dtype)


def takes_fp8_inputs(backend: str | None) -> bool:
    """Whether attention with this backend (after the `H3GEN_ATTENTION_BACKEND` override) wants e4m3 inputs, so a
    caller can hand them over through `fp8_attention` instead of quantizing bf16 q/k/v inside `attention`."""
    return (os.environ.get("H3GEN_ATTENTION_BACKEND") or backend) == "fa3-fp8"


def resolve_backend(
    backend: str | None, device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128
) -> str:
    """The concrete backend `attention` will use for heads of `dtype` and `head_dim` on `device`:
    `H3GEN_ATTENTION_BACKEND` when set (an override for every call), else `backend`, else "sdpa". A named backend
    that cannot take these inputs raises ValueError."""
    name = os.environ.get("H3GEN_ATTENTION_BACKEND") or backend or "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    if name == "auto":
        major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
        name = _auto_backend(
            device.type, major, dtype, head_dim, fa3_kernel() is not None, torch.backends.cudnn.is_available()
        )
    if name in ("fa3", "fa3-fp8") and fa3_kernel() is None:
        raise ValueError("attention backend 'fa3' needs FlashAttention-3 (flash_attn_interface), not importable.")
    if name in _HALF_ONLY and not _takes(dtype, head_dim, _HALF_ONLY[name]):
        raise ValueError(
            f"attention backend {name!r} takes fp16 or bf16 heads of a multiple of 8 up to "
            f"{_HALF_ONLY[name]} channels, got {dtype} heads of {head_dim}; use 'auto' or 'sdpa'."
        )
    return name


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, backend: str | None = None, layout: str = "bshd"
) -> torch.Tensor:
    """Softmax attention of every row over every row, scale 1/sqrt(head_dim).

    Args:
        query, key, value: one dtype (fp32, fp16 or bf16), same device, `(batch, seq_len, heads, head_dim)` for
            layout "bshd" or `(batch, heads, seq_len, head_dim)` for "bhsd"; key and value may have another
            length than query (every query attends to every key).
        backend: one of `available_attention_backends()`.
    Returns:
        The output in the input layout and dtype.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    seq_axis = 1 if layout == "bshd" else 2
    other = [d for d in range(4) if d != seq_axis]
    if (
        query.ndim != 4
        or key.shape != value.shape
        or key.ndim != 4
        or [query.shape[d] for d in other] != [key.shape[d] for d in other]
    ):
        raise ValueError(
            "attention expects 4-D query, key and value that differ at most in the key/value length, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    name = resolve_backend(backend, query.device, query.dtype, query.shape[-1])
    if name in ("fa3", "fa3-fp8"):
        if layout == "bhsd":
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        if name == "fa3-fp8":
            out = _fa3_fp8(query, key, value)
        else:
            out = fa3_kernel()(query, key, value, causal=False)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2) if layout == "bhsd" else out
    if layout == "bshd":
        query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    if name in _SDPA_BACKENDS:
        with sdpa_kernel(_SDPA_BACKENDS[name]):
            out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    else:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3) if layout == "bshd" else out
