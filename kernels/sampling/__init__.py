"""`draw_token` (and `draw_tokens` for rows sharing their parameters): one token from a row of logits with temperature,
top-k and top-p, given the row's Exp(1) noise (see `reference`): one Triton program on CUDA, torch elsewhere."""

from h3gen.kernels._dispatch import use_triton
from h3gen.kernels.sampling import reference


def draw_token(values, order, noise, temperature, top_k, top_p):
    """`values` `[V]` (sorted descending when `order` `[V]` is given), `noise` `[V]` float32 -> `[1]` int64 id."""
    if use_triton(values):
        from h3gen.kernels.sampling import triton as fast  # on first use: see _dispatch

        return fast.draw_token(values, order, noise, temperature, top_k, top_p)
    return reference.draw_token(values, order, noise, temperature, top_k, top_p)


def draw_tokens(values, order, noise, temperature, top_k, top_p):
    """`draw_token` for each row of `[B, V]` `values` / `order` / `noise`, all rows by the same parameters ->
    `[B]` int64."""
    if use_triton(values):
        from h3gen.kernels.sampling import triton as fast  # on first use: see _dispatch

        return fast.draw_tokens(values, order, noise, temperature, top_k, top_p)
    return reference.draw_tokens(values, order, noise, temperature, top_k, top_p)


__all__ = ["draw_token", "draw_tokens"]
