"""What the H3 kernel tests share: the device (a GPU, else the CPU with the Triton interpreter, set before any
kernel is defined: import this module first), dtypes, shapes, random inputs and the error measure."""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter gets bf16 wrong: fp16 stands in for it on the CPU.
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
SHAPES = [(1, 37, 200), (2, 5, 96), (1, 64, 328)]


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
