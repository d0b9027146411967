"""Token drawing (temperature, top-k, top-p): the one-program Triton draw against the torch reference."""

import pytest
import torch
from helpers.kernel_cases import DEVICE

from h3gen.kernels.sampling import reference as sampling_ref
from h3gen.kernels.sampling import triton as sampling_triton


@pytest.mark.parametrize(
    "temperature,top_k,top_p,flat",
    [
        (0.7, 0, 1.0, False),
        (1.3, 0, 0.9, False),
        (1.0, 40, 1.0, False),
        (0.9, 300, 0.95, False),
        (1.0, 0, 0.97, True),
        (2.0, 4000, 0.5, True),
    ],
)
def test_draw_token_matches_reference(temperature, top_k, top_p, flat):
    """The one-program draw against the torch composition, token for token over many noise draws: unsorted rows
    (temperature only), top-k with tied logits at the k-th place, top-p cut in a later chunk of a flat row, masked
    (-inf) logits, a width that is no multiple of the chunk."""
    width = 5000
    g = torch.Generator(device=DEVICE).manual_seed(top_k + int(top_p * 100))
    logits = torch.randn(width, generator=g, device=DEVICE) * (0.05 if flat else 3.0)
    logits[7] = logits[8] = logits.max() + 0.5  # a tie at the top
    logits[100:150] = float("-inf")
    sort = top_k > 0 or top_p < 1.0
    values, order = torch.sort(logits, descending=True) if sort else (logits, None)
    if top_k:
        values[top_k - 2 : top_k + 2] = values[top_k - 1]  # ties with the k-th value are kept
    for draw in range(12):
        noise = torch.empty(width, device=DEVICE).exponential_(generator=g)
        got = sampling_triton.draw_token(values, order, noise, temperature, top_k, top_p, block=1024)
        want = sampling_ref.draw_token(values, order, noise, temperature, top_k, top_p)
        assert got.dtype == torch.int64 and torch.equal(got, want), draw
    with pytest.raises(ValueError, match="sorted"):
        sampling_triton.draw_token(logits, None, noise, 1.0, 5, 1.0)


@pytest.mark.parametrize("sort,top_k,top_p", [(False, 0, 1.0), (True, 0, 0.9), (True, 30, 0.95)])
def test_draw_tokens_of_a_batch_match_reference(sort, top_k, top_p):
    """One program per row, every row by the same parameters: each row's token as the reference draws it."""
    g = torch.Generator(device=DEVICE).manual_seed(top_k + 3)
    logits = torch.randn(3, 2100, generator=g, device=DEVICE) * 2.0
    values, order = torch.sort(logits, dim=-1, descending=True) if sort else (logits, None)
    for _ in range(4):
        noise = torch.empty(3, 2100, device=DEVICE).exponential_(generator=g)
        got = sampling_triton.draw_tokens(values, order, noise, 0.8, top_k, top_p, block=512)
        assert got.shape == (3,) and torch.equal(got, sampling_ref.draw_tokens(values, order, noise, 0.8, top_k, top_p))
