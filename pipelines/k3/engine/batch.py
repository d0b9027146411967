"""The cache objects one engine forward hands to `K3ForCausalLM`: ragged views into the memory pool.

The model's layers only need, per MLA layer, something with `length`, `append(rows)`, `rows()`, `pages`,
`block_table()` and `seq_lens()` (the `PagedLatentCache` interface), and per KDA layer a batched `KDAState`.
`LatentView` gives each sequence of the batch its own length, so a decode batch may mix sequences of any lengths;
a prefill chunk runs one sequence at a time (the model's expanded attention takes one `past` per call).
"""

import torch

from h3gen.pipelines.k3.cache import KDAState


class LatentView:
    """MLA latent rows of a batch, living in the pool's pages. Rows for positions `starts[b] ..` are written by
    `append`; the pages they need are allocated by the scheduler beforehand."""

    def __init__(self, pages: torch.Tensor, tables: list[list[int]], starts: list[int], page_size: int):
        self.pages = pages  # [P, page_size, D], a strided view of the pool
        self.page_size = page_size
        self.starts = starts
        width = max(1, max(len(t) for t in tables))
        self._table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=pages.device)
        self._lens = list(starts)
        # The model reads `length` as "rows before this call": it picks the decode path when it is > 0.
        self.length = min(starts)

    def append(self, rows: torch.Tensor) -> None:
        batch, count = rows.shape[:2]
        positions = torch.tensor(self._lens, device=rows.device)[:, None] + torch.arange(count, device=rows.device)
        page = self._table.long().gather(1, positions // self.page_size)
        self.pages[page, positions % self.page_size] = rows.to(self.pages.dtype)
        self._lens = [n + count for n in self._lens]

    def block_table(self) -> torch.Tensor:
        return self._table

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self._lens, dtype=torch.int32, device=self.pages.device)

    def rows(self) -> torch.Tensor:
        if len(self._lens) != 1:
            raise RuntimeError("expanded MLA attention over the pool runs one sequence at a time")
        length = self._lens[0]
        table = self._table[0, : -(-length // self.page_size)].long()
        return self.pages[table].flatten(0, 1)[:length][None]


class BatchCache:
    """Duck type of `K3Cache` for one engine forward: a `LatentView` per MLA layer, a `KDAState` (or None for a
    sequence starting from nothing) per KDA layer; the model replaces the KDA entries with the new states."""

    def __init__(self, num_layers: int, page_size: int):
        self.layers: list = [None] * num_layers
        self.page_size = page_size
        self.seen_tokens = 0

    def kda_states(self, indices: list[int]) -> list[KDAState]:
        return [self.layers[i] for i in indices]
