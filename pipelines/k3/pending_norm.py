"""A residual update and the RMSNorm after it, left for the linear that reads the norm to compute.

In a decode step of a few tokens every sub-layer's input is `norm(h + delta)` read by one fused projection. A
`PendingNorm` hands that projection to `normed_rows_linear`, whose kernel adds, normalises and multiplies in one
launch, so the norm needs no kernel of its own. Anything else that needs the normalised rows (`value()`) gets them
from the ordinary norm kernels; either way the values are the reference's (`kernels.rmsnorm`)."""

import torch

from h3gen.kernels.gemv import normed_rows_linear, normed_rows_linear_argmax, rows_linear, rows_linear_argmax
from h3gen.kernels.rmsnorm import add_rms_norm, rms_norm


class PendingNorm:
    """`norm(h + delta)` (`norm(h)` without `delta`) `[..., D]`, with `norm` a `K3RMSNorm`, not yet computed."""

    def __init__(self, h: torch.Tensor, delta: torch.Tensor | None, norm):
        self.h, self.delta, self.weight, self.eps = h, delta, norm.weight, norm.eps
        self.shape, self.dtype, self.device = h.shape, h.dtype, h.device
        self._total = h if delta is None else None
        self._value: torch.Tensor | None = None

    def linear(self, weight: torch.Tensor) -> torch.Tensor:
        """`rows_linear(self.value(), weight)` `[..., N]`; the first call computes the norm in the linear's kernel."""
        if self._value is not None or (self._total is not None and self.delta is not None):  # computed already
            return rows_linear(self.value(), weight)
        self._total, out = normed_rows_linear(self.h, self.weight, self.eps, weight, self.delta)
        return out

    def linear_argmax(
        self, weight: torch.Tensor, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`self.linear(weight)` `[..., N]`, its argmax over N `[...]` int64, written into `into` when given), the
        argmax found by the linear's kernel where it can (`normed_rows_linear_argmax`)."""
        if self._value is not None or (self._total is not None and self.delta is not None):
            return rows_linear_argmax(self.value(), weight, into)
        self._total, out, index = normed_rows_linear_argmax(self.h, self.weight, self.eps, weight, self.delta, into)
        return out, index

    def value(self) -> torch.Tensor:
        """The normalised rows `[..., D]`."""
        if self._value is None:
            if self._total is None:
                self._total, self._value = add_rms_norm(self.h, self.delta, self.weight, self.eps)
            else:
                self._value = rms_norm(self._total, self.weight, self.eps)
        return self._value

    def total(self) -> torch.Tensor:
        """`h + delta` `[..., D]` (the residual stream after the update), computing the norm with it if nothing has
        read the norm yet."""
        if self._total is None:
            self.value()
        return self._total


def resolved(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """`x` itself, or a pending norm's value."""
    return x.value() if isinstance(x, PendingNorm) else x


def linear_rows(x: torch.Tensor | PendingNorm, weight: torch.Tensor) -> torch.Tensor:
    """`rows_linear(x, weight)` for a tensor or a pending norm (whose kernel then computes the norm)."""
    return x.linear(weight) if isinstance(x, PendingNorm) else rows_linear(x, weight)


def linear_rows_argmax(
    x: torch.Tensor | PendingNorm, weight: torch.Tensor, into: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_linear_argmax(x, weight, into)` for a tensor or a pending norm: (`[..., N]`, argmax `[...]` int64)."""
    return x.linear_argmax(weight, into) if isinstance(x, PendingNorm) else rows_linear_argmax(x, weight, into)
