"""The decode step's embedding-row kernel against its torch reference."""

import pytest
import torch
from helpers.kernel_cases import DEVICE


@pytest.mark.parametrize(
    "shape,width,dtype", [((1, 1), 64, torch.float32), ((3, 1), 1500, torch.float16), ((2, 5), 33, torch.float32)]
)
def test_embedding_rows_matches_reference(shape, width, dtype):
    """The decode step's embedding lookup: exact rows for ids anywhere in the table (the last row included), widths
    that are no multiple of the block; an id outside the table gives zeros, not other memory."""
    from h3gen.kernels.embedding import reference as emb_ref
    from h3gen.kernels.embedding import triton as emb_triton

    g = torch.Generator(device=DEVICE).manual_seed(width)
    table = torch.randn(50, width, generator=g, device=DEVICE).to(dtype)
    ids = torch.randint(0, 50, shape, generator=g, device=DEVICE)
    ids.view(-1)[0] = 49
    got = emb_triton.embedding_rows(ids, table, block=32)
    assert got.shape == (*shape, width) and torch.equal(got, emb_ref.embedding_rows(ids, table))
    ids.view(-1)[-1] = 50
    assert not emb_triton.embedding_rows(ids, table).view(-1, width)[-1].any()
