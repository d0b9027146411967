"""Token embedding lookup: `embedding_rows(ids, weight)` (= `F.embedding`). A decode step's few ids on CUDA take the
Triton kernel (launched so the step's first projection overlaps it, see `triton.py`); anything else the torch
reference."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.embedding import reference

MAX_IDS = 64  # more ids (a prefill) gain nothing from the kernel


def embedding_rows(ids, weight):
    """`ids` `[...]` int, `weight` `[V, D]` -> `[..., D]` in weight.dtype (see `reference.embedding_rows`)."""
    if 0 < ids.numel() <= MAX_IDS and use_triton(weight) and weight.stride(-1) == 1:
        from h3gen.kernels.embedding import triton as fast  # on first use: see _dispatch

        return fast.embedding_rows(ids, weight)
    return reference.embedding_rows(ids, weight)


__all__ = ["MAX_IDS", "embedding_rows"]
