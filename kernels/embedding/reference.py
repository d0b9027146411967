"""Token embedding lookup in plain torch."""

import torch
import torch.nn.functional as F


def embedding_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ids` `[...]` int, `weight` `[V, D]` -> `[..., D]` in weight.dtype: the table's rows picked by id."""
    return F.embedding(ids, weight)
