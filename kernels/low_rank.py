"""The low-rank update some kernels add to their input as they read it.

An unmerged LoRA of a linear adds `hidden @ up^T` to the linear's output (`hidden` = `x A^T` `(M, r)`, `up` =
`scale * B` `(N, r)`). When the next op is a fused kernel that reads that output anyway (SwiGLU, q/k norm + RoPE),
the kernel takes the pair as `update` and adds it per tile, which saves the separate pass that would read and
write the whole output. `add_update` is the plain-torch meaning of that argument."""

import torch


def add_update(x: torch.Tensor, update: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`x` `(..., N)` plus a low-rank `update` `(hidden (M, r), up (N, r))`, M = x's rows: `x + hidden @ up^T` in
    x.dtype (the product in hidden's dtype); x itself when `update` is None."""
    if update is None:
        return x
    hidden, up = update
    return x + (hidden @ up.to(hidden.dtype).t()).to(x.dtype).view(x.shape)
