"""What the kernel tests share: the device (a GPU, else the CPU with the Triton interpreter, set before any
kernel is defined: import this module first), dtypes, shapes, tolerances, random inputs, the error measure and
the e4m3 comparisons of the `fast` tier's kernels."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from h3gen.kernels.fp8_quant import Fp8Rows

DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter gets bf16 wrong: fp16 stands in for it on the CPU.
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
SHAPES = [(1, 37, 200), (2, 5, 96), (1, 64, 328)]
# Reference and kernel round differently (the kernel rounds once, at the end): allow a few ulps of the dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def case(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def rand(*shape, dtype, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator, device=DEVICE) * scale).to(dtype)


def err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def half_block_inputs(shape, dtype, seed: int):
    """The inputs of the residual and norm kernels: `x`, `y` `shape` (B, S, H), a norm weight `(H,)`, gate,
    shift and scale as column slices of one `(5, 3H)` table (as the model passes them), `index` `(S,)`."""
    g = case(seed)
    hidden = shape[-1]
    x, y = rand(*shape, dtype=dtype, generator=g), rand(*shape, dtype=dtype, generator=g)
    weight = rand(hidden, dtype=dtype, generator=g)
    table = rand(5, 3 * hidden, dtype=dtype, generator=g)
    gate, shift, scale = table[:, :hidden], table[:, hidden : 2 * hidden], table[:, 2 * hidden :]
    index = torch.randint(0, 5, (shape[1],), generator=g, device=DEVICE)
    return x, y, weight, gate, shift, scale, index


def qk_inputs(heads: int, head_dim: int, rotary: int, dtype, seed: int, batch: int = 2, seq: int = 19):
    """The inputs of q/k norm + RoPE: `q`, `k` `(batch, seq, heads, head_dim)`, norm weights `(head_dim,)` each,
    and `cos`, `sin` `(seq, rotary)` float32 whose two halves repeat (as the model's rotary embedding builds them)."""
    g = case(seed)
    q, k = (rand(batch, seq, heads, head_dim, dtype=dtype, generator=g) for _ in range(2))
    wq, wk = (rand(head_dim, dtype=dtype, generator=g) for _ in range(2))
    angles = torch.rand(seq, rotary // 2, generator=g, device=DEVICE) * 40
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, wq, wk, angles.cos(), angles.sin()


def assert_same_fp8(got: torch.Tensor, expected: torch.Tensor):
    """Two e4m3 tensors equal up to one rounding step (kernel and reference round float32 values computed in a
    different order). Under the CPU interpreter its e4m3 cast also drops the carry into the next power of two
    (7.9 -> 4 where 8 is right, 0.0017 -> 0 where 2^-9 is), which a GPU never does: allowed there only."""
    assert got.dtype == expected.dtype == torch.float8_e4m3fn and got.shape == expected.shape
    g, e = got.float(), expected.float()
    codes = (got.view(torch.uint8).int() - expected.view(torch.uint8).int()).abs()
    ok = (g == e) | ((codes <= 1) & (g.sign() == e.sign()))
    if not ON_GPU:
        ok |= ((2 * g == e) | (g == 0)) & (e.abs().log2() == e.abs().log2().round())
    assert ok.all(), f"{(~ok).sum().item()} of {ok.numel()} e4m3 values differ by more than one step"


def assert_same_rows(got: Fp8Rows, expected: Fp8Rows, source: torch.Tensor):
    assert isinstance(got, Fp8Rows) and got.scale.shape == expected.scale.shape
    assert torch.allclose(got.scale, expected.scale, rtol=1e-5, atol=0)
    assert_same_fp8(got.values, expected.values)
    assert err(dequantized(got.values, expected.values) * got.scale, source.reshape(-1, source.shape[-1])) < 0.05


def dequantized(got, expected):
    """The values to check the quantization error on: the kernel's on a GPU; the reference's under the CPU
    interpreter (whose carry bug, allowed by `assert_same_fp8`, would dominate the error)."""
    values = got if ON_GPU else expected
    return values.reshape(-1, values.shape[-1]).float()
