"""`argmax_rows(x)`: each row's argmax as `x.argmax(dim=-1)` gives it (first index of the maximum, NaN the
largest), one Triton launch of many programs per row on CUDA for a decode step's logits, torch elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.argmax import reference

MIN_WIDTH = 8192  # narrower rows: torch's one block per row is as fast


def argmax_rows(x):
    """`x` `[B, V]` -> `[B]` int64 (see `reference.argmax_rows`)."""
    if x.dim() == 2 and x.shape[1] >= MIN_WIDTH and use_triton(x):
        from h3gen.kernels.argmax import triton as fast  # on first use: see _dispatch

        return fast.argmax_rows(x)
    return reference.argmax_rows(x)


__all__ = ["argmax_rows"]
