"""Drawing one token from a row of logits with temperature, top-k and top-p, given the row's exponential noise (so
the draw is a function of its inputs: the noise comes from the request's generator).

The draw is the exponential race: among the kept tokens, the one with the largest `weight / noise`, where `weight`
is proportional to the token's probability and `noise` ~ Exp(1) independently per token; that token is distributed
as the weights are (the same rule `torch.multinomial` uses for one sample). Kept tokens: with top-k, those whose logit
reaches the k-th largest (ties kept); then with top-p, the smallest prefix in descending order whose probability mass
reaches top_p (the best token always)."""

import torch


def draw_token(
    values: torch.Tensor, order: torch.Tensor | None, noise: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """`values` `[V]` logits (any float dtype; sorted descending when `order` `[V]` int64 is given, `order[i]`
    being the vocabulary id of `values[i]`), `noise` `[V]` float32 Exp(1) draws, `temperature` > 0 -> `[1]` int64
    vocabulary id. Without `order`, top-k and top-p must be off (0 and 1.0)."""
    if order is None and (top_k > 0 or top_p < 1.0):
        raise ValueError("draw_token: top-k and top-p need the values sorted (pass their order).")
    scaled = values.float() / temperature
    weights = torch.exp(scaled - scaled.max())
    if order is not None and 0 < top_k < values.shape[-1]:
        weights = torch.where(scaled >= scaled[top_k - 1], weights, torch.zeros_like(weights))
    if order is not None and top_p < 1.0:
        before = torch.cumsum(weights, dim=-1) - weights  # the mass ahead of each token
        weights = torch.where(before < top_p * weights.sum(), weights, torch.zeros_like(weights))
    # an excluded token (weight 0) scores 0 whatever its noise (0 / 0 would be NaN, which argmax would pick)
    best = torch.argmax(torch.where(weights > 0, weights / noise, torch.zeros_like(weights))).reshape(1)
    return best if order is None else order[best]


def draw_tokens(
    values: torch.Tensor, order: torch.Tensor | None, noise: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """`draw_token` for each row of `values`, `order` and `noise` `[B, V]`, every row by the same parameters ->
    `[B]` int64."""
    return torch.cat(
        [
            draw_token(values[i], None if order is None else order[i], noise[i], temperature, top_k, top_p)
            for i in range(values.shape[0])
        ]
    )
