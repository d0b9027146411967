"""Per-request state a K3 forward carries from one call to the next.

KDA layers keep a fixed-size state: the last `W - 1` raw (pre-conv) `[q|k|v]` rows and the `[H, K, V]` float32
recurrent state. MLA layers keep one latent row `[c_kv | k_pe]` per token in fixed-size pages (`PagedLatentCache`),
which the paged decode kernel reads through a block table. All sequences of a batch have the same length.
"""

from dataclasses import dataclass

import torch


@dataclass
class KDAState:
    conv: torch.Tensor  # [B, W - 1, 3 * H * K] float32
    recurrent: torch.Tensor  # [B, H, K, V] float32
    # With `rows` `[B]` (int64, on the device), `conv` and `recurrent` are a whole pool of states and sequence b's
    # is row `rows[b]`: a decode step updates them where they lie (no gathered copy).
    rows: torch.Tensor | None = None


class PagedLatentCache:
    """MLA latent rows in pages of `page_size` rows: `pages` `[P, page_size, D]`, `block_table` `[B, max_pages]`."""

    def __init__(self, batch: int, dim: int, dtype: torch.dtype, device, page_size: int = 16):
        self.page_size = page_size
        self.pages = torch.zeros(0, page_size, dim, dtype=dtype, device=device)
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        """Add `rows` `[B, T, D]` after the cached ones, allocating pages as needed."""
        batch, count = rows.shape[:2]
        needed = -(-(self.length + count) // self.page_size)
        grow = sum(needed - len(table) for table in self.tables)
        if grow:
            first = self.pages.shape[0]
            extra = self.pages.new_zeros(grow, self.page_size, self.pages.shape[-1])
            self.pages = torch.cat([self.pages, extra])
            for table in self.tables:
                missing = needed - len(table)
                table.extend(range(first, first + missing))
                first += missing
        positions = torch.arange(self.length, self.length + count, device=rows.device)
        table = self.block_table()
        page = table[:, positions // self.page_size]  # [B, T]
        self.pages[page, positions % self.page_size] = rows.to(self.pages.dtype)
        self.length += count

    def block_table(self) -> torch.Tensor:
        return torch.tensor(self.tables, dtype=torch.int32, device=self.pages.device).view(len(self.tables), -1)

    def seq_lens(self) -> torch.Tensor:
        return torch.full((len(self.tables),), self.length, dtype=torch.int32, device=self.pages.device)

    def rows(self) -> torch.Tensor:
        """All cached rows, `[B, length, D]`."""
        table = self.block_table().long()
        return self.pages[table].flatten(1, 2)[:, : self.length]


class K3Cache:
    """One entry per layer: a `KDAState` or a `PagedLatentCache` (None until the layer first runs)."""

    def __init__(self, num_layers: int, page_size: int = 16):
        self.layers: list = [None] * num_layers
        self.page_size = page_size
        self.seen_tokens = 0
