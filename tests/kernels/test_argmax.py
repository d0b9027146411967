"""The row argmax kernel against `torch.argmax`: first index of the maximum, NaN and -inf rows, counters left at
zero."""

import pytest
import torch
from helpers.kernel_cases import DEVICE

from h3gen.kernels.argmax import reference as argmax_ref
from h3gen.kernels.argmax import triton as argmax_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width,block", [(1, 5000, 1024), (3, 777, 256), (2, 300, 512), (5, 4099, 4096)])
def test_argmax_rows_matches_torch(rows, width, block, dtype):
    """First index of the maximum per row, over chunks (the last partial, one chunk when the row fits), with the
    maximum repeated across chunks (the first wins), a NaN (it wins, as in torch) and a row of -inf; twice in a row,
    so the arrival counters are back at zero after each launch."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * 31 + width)
    x = torch.randn(rows, width, generator=g, device=DEVICE).to(dtype)
    top = x.max() + 1
    x[0, width // 3] = top
    x[0, width - 1] = top  # a tie in a later chunk: the earlier index wins
    if rows > 1:
        x[1, width // 2] = float("nan")
        x[1, 0] = float("inf")
    if rows > 2:
        x[2] = float("-inf")
    for _ in range(2):
        got = argmax_triton.argmax_rows(x, block=block)
        assert got.dtype == torch.int64 and torch.equal(got, argmax_ref.argmax_rows(x))
    with pytest.raises(ValueError, match="empty"):
        argmax_triton.argmax_rows(x[:, :0])
