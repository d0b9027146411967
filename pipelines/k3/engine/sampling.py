"""Sampling parameters and the per-row sampler: temperature, top-k, top-p, a seed per request."""

from dataclasses import dataclass, field

import torch

from h3gen.errors import RequestError
from h3gen.kernels.sampling import draw_token, draw_tokens


@dataclass
class SamplingParams:
    """How one request draws its tokens. `temperature=0` is greedy (top-k / top-p then do nothing)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None  # None: drawn from torch's global generator
    stop: list[str] = field(default_factory=list)  # the text ends before the first stop string found
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r}).", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be between 0 and 100 (got {self.temperature}).", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p}).", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (got {self.top_k}).", "top_k")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings.", "stop")
        return self

    def generator(self, device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        else:
            gen.manual_seed(int(self.seed))
        return gen


def draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token `[1]` int64 (on the row's device) from `row` `[V]` logits by `params` (temperature > 0) and the
    request's generator: Exp(1) noise per token from the generator, the row sorted when top-k or top-p needs it,
    then `draw_token` (one kernel on a GPU): the tokens top-k and top-p keep, drawn by their probabilities."""
    noise = torch.empty(row.shape[-1], dtype=torch.float32, device=row.device).exponential_(generator=generator)
    if params.top_p < 1.0 or 0 < params.top_k < row.shape[-1]:
        # stable: tied logits keep their vocabulary order, so a row draws the same alone or in a batch
        values, order = torch.sort(row, descending=True, stable=True)
        return draw_token(values, order, noise, params.temperature, params.top_k, params.top_p)
    return draw_token(row, None, noise, params.temperature, 0, 1.0)


def draw_batch(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """`draw` for every row of `logits` `[B, V]` when all rows sample by the same `params`: each row's noise from its
    own generator (as `draw` makes it), one sort and one kernel for the batch -> `[B]` int64 (the tokens `draw`
    gives row by row)."""
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for row, generator in zip(noise, generators, strict=True):
        row.exponential_(generator=generator)
    if params.top_p < 1.0 or 0 < params.top_k < logits.shape[-1]:
        values, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        return draw_tokens(values, order, noise, params.temperature, params.top_k, params.top_p)
    return draw_tokens(logits.contiguous(), None, noise, params.temperature, 0, 1.0)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    argmax: torch.Tensor | None = None,
) -> list[int]:
    """One token per row of `logits` `[B, V]`, each row by its own parameters and generator; `argmax` `[B]`: the
    rows' argmax when already computed (the decode graphs do, on the device)."""
    if argmax is None and any(p.temperature == 0.0 for p in params):
        argmax = logits.float().argmax(dim=-1)
    if all(p.temperature == 0.0 for p in params):
        return argmax.tolist()
    return sample_on_device(logits, params, generators, argmax).tolist()


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator], argmax: torch.Tensor
) -> torch.Tensor:
    """`sample` without reading anything back: `[B]` int64 tokens on the logits' device, greedy rows from `argmax`
    `[B]`, the others by `draw` with their generators (so the same tokens as `sample`), for a step that is launched
    before the host has them."""
    first = params[0]
    if (
        len(params) > 1
        and first.temperature != 0.0
        and all((p.temperature, p.top_k, p.top_p) == (first.temperature, first.top_k, first.top_p) for p in params)
    ):
        return draw_batch(logits, first, generators)  # a planner's batch: every row samples alike
    rows = []
    for index, (row, p, gen) in enumerate(zip(logits, params, generators, strict=True)):
        rows.append(argmax[index : index + 1] if p.temperature == 0.0 else draw(row, p, gen))
    return torch.cat(rows)
