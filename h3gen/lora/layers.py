"""Unmerged LoRA on the linears of `h3gen.linear`, and merging into dense weights.

An adapter's update of one linear is `delta W = scale * B A` (`A` `(rank, in)`, `B` `(out, rank)`). Applied
unmerged, the layer computes `y = base(x) + (x A^T) (scale B)^T` for every active adapter. Linears that read the
same input tensor (an attention's q, k and v) form a `LoraGroup`: one GEMM projects the input onto all of their
stacked `A`s (an `A` they share, as a fused-QKV file's, once), then each member adds its own `x A^T` slice times its
stacked `scale * B`s in one GEMM. The group's tensors are plain attributes, never parameters or buffers: a
layer-wise offload that streams a block's weights leaves them where they are (on the GPU, for the whole request).

How the update reaches each kind of base:
  - a group of resident linears (not tensor parallel) built with `wide=True` whose input the block writes through
    `wide_input` (the lossless tier's q/k/v, SwiGLU projection and ff.net.2; the fast tier's FP8 linears, to_out
    too): the update runs inside the layer's own GEMM as more columns of its K loop, `[x | x A^T]` by
    `[W | scale B]`, in the weight's dtype or in e4m3 (`h3gen.lora.wide`);
  - dense `nn.Linear` given any other input (the lossless to_out, whose input the attention kernel writes; layers
    under layer-wise offload): the layer's forward is replaced while the group is attached: it writes the update
    (`x A^T (scale B)^T`, plus the bias) first and lets the layer's own GEMM add `x W^T` into it (beta = 1). That
    moves as many bytes as adding the update after the GEMM (which reads and writes the output once more), and on
    the H200 it measured faster in the whole step at both row counts (benchmarks/RESULTS.md);
  - `Fp8Linear` given any other input, `MXFP4Linear` (their GEMMs take no matrix to add into): a forward hook adds
    it to the layer's output. An FP8 layer's input may be e4m3 `Fp8Rows` from a fused kernel: the A projection
    then runs as an FP8 GEMM like the layer's own (`h3gen.quant.fp8.fp8_matmul`, A quantized per rank row, its rows
    padded to the GEMM's multiple of 16), reading the e4m3 rows as they are; `x A^T` comes out in the compute dtype
    and the B product stays there. Widening the rows to bf16 for a bf16 A GEMM instead cost one more pass over the
    input per group and a GEMM at half the FP8 rate (benchmarks/RESULTS.md);
  - tensor-parallel shards: the layer's `partial_hook` adds this rank's share before any collective. A
    column-parallel shard keeps `A` whole and its rows of `B` (per logical split, as its weight); a row-parallel
    shard keeps its input columns of `A` and `B` whole, so the partial sums add up over the all-reduce.
"""

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.fp8_quant import FP8, Fp8Rows, append_scaled_columns
from h3gen.lora.wide import column_factors, extended_weight, up_columns
from h3gen.parallel.tp_linear import ColumnParallelLinear, RowParallelLinear
from h3gen.quant.fp8 import Fp8Linear, fp8_matmul, fp8_weight

# SGLang's rule for merging: an adapter stays unmerged when merging would round away more than this share of its
# update (by norm), as distilled adapters below one bf16 ulp of the weights do.
AUTO_MERGE_MAX_ROUNDING_LOSS = 0.5


@dataclass
class LoraFactors:
    """One adapter's update of one linear, `delta W = scale * up @ down`: `down` (A) `(rank, in_features)`, `up` (B)
    `(out_features, rank)`, full size (not cut to a tensor-parallel shard), any float dtype, any device."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float


def compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear's output comes in: its `compute_dtype` (FP8 / MXFP4 layers) or its weight's dtype."""
    dtype = getattr(layer, "compute_dtype", None)
    return dtype if dtype is not None else layer.weight.dtype


def _tensor_parallel(layer: nn.Module) -> bool:
    return isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.state.tp > 1


def shard_factors(layer: nn.Module, down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(down, up)` cut to what this rank of a tensor-parallel `layer` applies: a column-parallel layer's rows of
    `up` (its chunk of every logical split, as `load_shard` cuts its weight), a row-parallel layer's input columns of
    `down`; unchanged for any other layer."""
    if not _tensor_parallel(layer):
        return down, up
    if isinstance(layer, ColumnParallelLinear):
        return down, layer.load_shard("weight", up)
    step = layer.in_features // layer.state.tp
    return down[:, layer.state.tp_rank * step : (layer.state.tp_rank + 1) * step], up


def _on(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` in float32, copied in its own (narrower) dtype and widened there."""
    return tensor.to(device, non_blocking=True).float()


@dataclass
class _Member:
    layer: nn.Module
    # (column in the group's projected input, column in `up`, width) of each contiguous run of this member's A's
    segments: list[tuple[int, int, int]]
    up: torch.Tensor  # (out_local, sum of ranks): its adapters' scale * B side by side, in the layer's compute dtype
    handle: object = None  # the forward hook's handle, or None where the layer's forward was replaced
    # K-extended (`h3gen.lora.wide`) when set: the columns [start, stop) of the group's wide buffer it reads, and
    # the column of that window where the input `x` begins (its projected columns lie right of x, or left of it for
    # a group's first member; see `LoraGroup._lay_out_wide`)
    wide_span: tuple[int, int] | None = None
    wide_x: int = 0
    wide_weight: torch.Tensor | None = None  # once extended: (out, stop - start), the layer's weight a view of it


@dataclass
class LoraGroup:
    """Active adapters on linears that share one input (see the module docstring). Build with `LoraGroup.build`,
    then `attach()`; `detach()` restores the plain layers."""

    down: torch.Tensor  # (rows, in_local): every distinct A of the members, stacked, in the compute dtype
    members: list[_Member]
    _down_fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # `down` as e4m3 rows and their scales (fast tier)
    wide: bool = False  # whether members run their update inside their GEMM (`h3gen.lora.wide`)
    _factors: torch.Tensor | None = None  # K-extended FP8: the factor `c` of each projected column (rows of _down_fp8,)
    _extended: bool = False  # K-extended: whether the members' weights are extended (on the first `wide_input`)
    _left_width: int = 0  # K-extended: the projected columns the buffer also holds left of x (see _lay_out_wide)
    _input: object = None
    _hidden: torch.Tensor | None = None
    _uses_left: int = 0
    _wide_x: object = None  # the input `wide_input` handed out last (`Fp8Rows`), and its buffer
    _wide_buffer: torch.Tensor | None = None
    attached: bool = field(default=False)

    @classmethod
    def build(cls, members: list[tuple[nn.Module, list[LoraFactors]]], device, wide: bool = False) -> "LoraGroup":
        """A group over `members` (each a linear and the adapters on it, in stacking order), its tensors on `device`
        in each layer's compute dtype. Every member must read an input of the same width and dtype. An A given to
        several members as the same tensor (a fused QKV file's shared A) is projected once. `wide=True` lets a group
        of `Fp8Linear`s, or of 16- or 32-bit float `nn.Linear`s, on `device` (none tensor-parallel) run its updates
        inside their GEMMs when its input comes from `wide_input`; the caller keeps their weights where they are
        while attached (no layer-wise offload)."""
        downs, built, rows, placed = [], [], 0, {}
        dtype = None
        for layer, factors in members:
            layer_dtype = compute_dtype(layer)
            if dtype is not None and layer_dtype != dtype:
                raise ValueError(
                    f"LoRA group members compute in {dtype} and {layer_dtype}; group only layers "
                    "that read the same input."
                )
            dtype = layer_dtype
            segments, ups, column = [], [], 0
            for f in factors:
                down, up = shard_factors(layer, f.down, f.up)
                if id(f.down) not in placed:  # the members of one group are cut alike, so one A stays one A
                    placed[id(f.down)] = rows
                    downs.append(_on(down, device))
                    rows += down.shape[0]
                offset, rank = placed[id(f.down)], down.shape[0]
                if segments and segments[-1][0] + segments[-1][2] == offset:
                    start, up_start, width = segments[-1]
                    segments[-1] = (start, up_start, width + rank)
                else:
                    segments.append((offset, column, rank))
                ups.append(_on(up, device) * f.scale)
                column += rank
            built.append(_Member(layer, segments, torch.cat(ups, dim=1).to(dtype).contiguous()))
        widths = {d.shape[1] for d in downs}
        if len(widths) != 1:
            raise ValueError(f"LoRA group members read inputs of widths {sorted(widths)}; they must share one input.")
        group = cls(torch.cat(downs).to(dtype).contiguous(), built)
        layers = [layer for layer, _ in members]
        fp8 = all(type(layer) is Fp8Linear for layer in layers)
        dense = all(
            type(layer) is nn.Linear and layer.weight.dtype.is_floating_point and layer.weight.dtype.itemsize >= 2
            for layer in layers
        )
        if (
            wide
            and (fp8 or dense)
            and all(layer.weight.device == group.down.device and not _tensor_parallel(layer) for layer in layers)
        ):
            group._lay_out_wide(16 if fp8 else 8)  # FP8 GEMMs take K in multiples of 16; 16-byte rows for the others
        return group

    def _lay_out_wide(self, align: int) -> None:
        """Make the group K-extended: choose the columns of the wide buffer (`wide_input`) each member reads,
        `align`-column groups whole. Where the first member's A rows are its own and fill whole groups (the q of an
        adapter with an A per projection), they move to the end of `down` and the buffer holds their projection
        left of x too, so that no window spans another member's columns on that side: q, k and v with A's of their
        own then read 1, 1 and 2 ranks of extra columns instead of 1, 2 and 3 (benchmarks/RESULTS.md)."""
        self.wide = True
        first, others = self.members[0], self.members[1:]
        left = max(start + width for start, _, width in first.segments)
        exclusive = all(start >= left for member in others for start, _, _ in member.segments)
        if others and exclusive and left % align == 0 and left < self.down.shape[0]:
            rows = self.down.shape[0]
            self.down = torch.cat([self.down[left:], self.down[:left]]).contiguous()
            first.segments = [(start + rows - left, up_start, width) for start, up_start, width in first.segments]
            for member in others:
                member.segments = [(start - left, up_start, width) for start, up_start, width in member.segments]
            self._left_width = left
        for member in self.members:
            in_features = member.layer.in_features
            if member is first and self._left_width:
                member.wide_span, member.wide_x = (0, left + in_features), left
            else:
                end = _multiple_of(max(start + width for start, _, width in member.segments), align)
                member.wide_span = (self._left_width, self._left_width + in_features + end)

    @property
    def nbytes(self) -> int:
        tensors = [self.down] + [m.up for m in self.members] + list(self._down_fp8 or ())
        extended = sum(
            (m.wide_weight.shape[1] - m.layer.in_features) * m.wide_weight.shape[0] * m.wide_weight.element_size()
            for m in self.members
            if m.wide_weight is not None
        )
        return sum(t.numel() * t.element_size() for t in tensors) + extended

    # ------------------------------------------------------------------ K-extended input

    @property
    def _fp8(self) -> bool:
        return type(self.members[0].layer) is Fp8Linear

    def _e4m3_down(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`down` as e4m3 rows (padded with zero rows to a multiple of 16) and their scales `(1, rows)`."""
        if self._down_fp8 is None:
            rows = self.down.shape[0]
            self._down_fp8 = fp8_weight(F.pad(self.down, (0, 0, 0, _multiple_of(rows, 16) - rows)))
        return self._down_fp8

    def _wide_down(self) -> torch.Tensor:
        """The A rows a K-extended group projects its input onto: e4m3 (`_e4m3_down`) or `down` padded with zero
        rows to a multiple of 8 (so its `x A^T` columns fill whole 16-byte groups)."""
        if self._fp8:
            return self._e4m3_down()[0]
        rows = self.down.shape[0]
        return self.down if rows % 8 == 0 else F.pad(self.down, (0, 0, 0, _multiple_of(rows, 8) - rows))

    def wide_input(self, shape, device):
        """A buffer for the group's next input `shape` `(..., in)`, to hand the kernel that produces the input as
        its `out`: columns `[L, L + in)` of rows `(rows, L + in + R)`, as `Fp8Rows` of e4m3 rows for FP8 members or
        a tensor in the compute dtype for dense ones. `x A^T` fills the last R columns (R: the projected columns,
        padded) and, where `_lay_out_wide` keeps the first member's L columns left of x (else L = 0), the first L
        too. Members called with that very object read their window of the buffer (`wide_span`). The first call
        extends the members' weights (a copy of each), so a group no kernel asks this of never does."""
        if not self._extended:
            self._extend_all()
        in_features, extra, rows = shape[-1], self._wide_down().shape[0], math.prod(shape[:-1])
        left = self._left_width
        buffer = torch.empty(
            rows, left + in_features + extra, dtype=FP8 if self._fp8 else self.down.dtype, device=device
        )
        if self._fp8:
            x = Fp8Rows(
                buffer[:, left : left + in_features].view(*shape),
                torch.empty(rows, 1, dtype=torch.float32, device=device),
            )
        else:
            x = buffer[:, left : left + in_features].view(*shape)
        self._wide_x, self._wide_buffer = x, buffer
        return x

    def _window_column(self, member: _Member, start: int) -> int:
        """The column of `member`'s window (`wide_span`) that holds projected column `start` (a row of `down`)."""
        if member.wide_x:  # the first member, reading the copy of its columns left of x
            return start - (self.down.shape[0] - self._left_width)
        return member.layer.in_features + start

    def _extend_all(self) -> None:
        """Each member's `[W | scale B]` (dense), or the columns' factors (`h3gen.lora.wide.column_factors`) and
        then each member's e4m3 `[W | B c / s_col]` (FP8), each B column where the member's window (`wide_span`)
        holds its projection; the layer's weight becomes a view of the columns under x."""
        self._extended = True
        if not self._fp8:
            for member in self.members:
                layer = member.layer
                blocks = [
                    (member.up[:, up_start : up_start + width], self._window_column(member, start))
                    for start, up_start, width in member.segments
                ]
                member.wide_weight = extended_weight(
                    layer.weight.detach(), blocks, member.wide_x, member.wide_span[1] - member.wide_span[0]
                )
                # the parameter keeps its identity
                layer.weight.data = member.wide_weight[:, member.wide_x : member.wide_x + layer.in_features]
            return
        values, scale = self._e4m3_down()
        peaks = torch.zeros(values.shape[0], device=values.device)
        for member in self.members:
            for start, up_start, width in member.segments:
                up = member.up[:, up_start : up_start + width].float() / member.layer.weight_scale.reshape(-1, 1)
                peaks[start : start + width] = torch.maximum(peaks[start : start + width], up.abs().amax(dim=0))
        norms = (values.float() * scale.reshape(-1, 1)).norm(dim=1)
        self._factors = column_factors(peaks, norms)
        for member in self.members:
            layer = member.layer
            blocks = [
                (
                    up_columns(
                        member.up[:, up_start : up_start + width],
                        layer.weight_scale,
                        self._factors[start : start + width],
                    ),
                    self._window_column(member, start),
                )
                for start, up_start, width in member.segments
            ]
            member.wide_weight = extended_weight(
                layer.weight, blocks, member.wide_x, member.wide_span[1] - member.wide_span[0]
            )
            layer._buffers["weight"] = member.wide_weight[:, member.wide_x : member.wide_x + layer.in_features]

    def _fill_wide(self, x) -> torch.Tensor:
        """Write `x A^T` into the wide buffer's last columns, in the compute dtype (dense) or as e4m3
        `x A^T / (s_row c)` (FP8, growing a row's scale where they need it: `append_scaled_columns`), and the first
        member's columns left of x too where it reads them there; returns the last columns."""
        buffer, left, down = self._wide_buffer, self._left_width, self._wide_down()
        end = buffer.shape[1] - down.shape[0]  # where x ends and its projection begins
        if not self._fp8:
            torch.mm(buffer[:, left:end], down.t(), out=buffer[:, end:])
        else:
            unit = torch.ones(buffer.shape[0], 1, dtype=torch.float32, device=buffer.device)
            projected = fp8_matmul(Fp8Rows(buffer[:, left:end], unit), down, self._e4m3_down()[1], None, torch.float32)
            append_scaled_columns(buffer[:, left:], x.scale, projected, self._factors)
        if left:
            rows = self.down.shape[0]
            buffer[:, :left].copy_(buffer[:, end + rows - left : end + rows])
        return buffer[:, end:]

    # ------------------------------------------------------------------ forward

    def _project(self, x) -> torch.Tensor:
        """The input's rows `(M, sum of ranks)` times every member's A."""
        if isinstance(x, Fp8Rows):
            hidden = fp8_matmul(x, *self._e4m3_down(), None, self.down.dtype)
            return hidden.reshape(-1, hidden.shape[-1])[:, : self.down.shape[0]]
        hidden = F.linear(x if x.dtype == self.down.dtype else x.to(self.down.dtype), self.down)
        return hidden.reshape(-1, hidden.shape[-1])

    def _hidden_for(self, x) -> torch.Tensor:
        # The first member called with a new input projects it for all; the last one to use it drops the reference.
        if self._input is not x:
            hidden = self._fill_wide(x) if x is self._wide_x else self._project(x)
            self._input, self._hidden, self._uses_left = x, hidden, len(self.members)
        hidden = self._hidden
        self._uses_left -= 1
        if self._uses_left <= 0:
            if x is self._wide_x:
                self._wide_x = self._wide_buffer = None
            self._input = self._hidden = None
        return hidden

    def apply(self, member: _Member, x, y: torch.Tensor) -> torch.Tensor:
        """`y` (the layer's output, or a TP rank's partial product) plus this member's update of input `x`."""
        hidden = self._hidden_for(x)
        in_place = y.dtype == member.up.dtype and y.is_contiguous()
        rows = y.view(-1, y.shape[-1]) if in_place else None
        for start, up_start, width in member.segments:
            part, up = hidden[:, start : start + width], member.up[:, up_start : up_start + width]
            if in_place:
                rows.addmm_(part, up.t())  # the add rides in the GEMM's epilogue
            else:
                y = y + (part @ up.t()).to(y.dtype).view(y.shape)
        return y

    def forward_update_first(self, member: _Member, x: torch.Tensor) -> torch.Tensor:
        """A dense `nn.Linear`'s forward with this member's update: `x` `(..., in)` -> `(..., out)` in the weight's
        dtype. The update (and the bias) is written first and the layer's GEMM adds `x W^T` into it."""
        layer, hidden = member.layer, self._hidden_for(x)
        out = None
        for start, up_start, width in member.segments:
            part, up = hidden[:, start : start + width], member.up[:, up_start : up_start + width]
            if out is None:
                out = torch.mm(part, up.t()) if layer.bias is None else torch.addmm(layer.bias, part, up.t())
            else:
                out.addmm_(part, up.t())
        out.addmm_(x.reshape(-1, x.shape[-1]), layer.weight.t())
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward_wide(self, member: _Member, x) -> torch.Tensor:
        """A K-extended member's forward: `x` (`Fp8Rows` or a tensor `(..., in)`) -> `(..., out)` in the compute
        dtype. Given the input `wide_input` handed out, one GEMM over its window of the buffer (`wide_span`) by its
        extended weight, `[W | scale B]` (dense) or e4m3 `[W | B c / s_col]` (FP8), the B columns under their
        projections; given any other input, the layer's GEMM with the update written first (dense) or added after
        it (FP8)."""
        layer, buffer = member.layer, self._wide_buffer
        if x is not self._wide_x:
            if not self._fp8:
                return self.forward_update_first(member, x)
            return self.apply(member, x, type(layer).forward(layer, x))
        self._hidden_for(x)  # the group's first call with this input fills the buffer's projected columns
        start, stop = member.wide_span
        if not self._fp8:
            out = F.linear(buffer[:, start:stop], member.wide_weight, layer.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        columns = Fp8Rows(buffer[:, start:stop], x.scale)
        out = fp8_matmul(columns, member.wide_weight, layer.weight_scale, layer.bias, layer.compute_dtype)
        return out.view(*x.values.shape[:-1], out.shape[-1])

    # ------------------------------------------------------------------ hooks

    def attach(self) -> "LoraGroup":
        """Hook every member layer (a layer holds at most one group at a time)."""
        for member in self.members:
            layer = member.layer
            if getattr(layer, "lora_group", None) is not None:
                raise ValueError(f"a {type(layer).__name__} already carries a LoRA group; detach it first.")
            layer.lora_group = self
            if member.wide_span:  # its weight is extended on the first `wide_input` (never, if no kernel asks)
                layer.forward = partial(self.forward_wide, member)  # an instance attribute: see detach
            elif _tensor_parallel(layer):
                layer.partial_hook = partial(self.apply, member)
            elif type(layer) is nn.Linear:
                layer.forward = partial(self.forward_update_first, member)  # an instance attribute: see detach
            else:
                # Ahead of other forward hooks: the update belongs to the layer's own output (Ulysses gathers the
                # rows of the output heads in a hook of its own).
                member.handle = layer.register_forward_hook(
                    lambda module, args, out, member=member: self.apply(member, args[0], out), prepend=True
                )
        self.attached = True
        return self

    def detach(self) -> None:
        for member in self.members:
            if member.handle is not None:
                member.handle.remove()
                member.handle = None
            if _tensor_parallel(member.layer):
                member.layer.partial_hook = None
            if member.wide_weight is not None:  # the weight back in a tensor of its own
                start = member.wide_x
                weight = member.wide_weight[:, start : start + member.layer.in_features].contiguous()
                if isinstance(member.layer.weight, nn.Parameter):
                    member.layer.weight.data = weight
                else:
                    member.layer._buffers["weight"] = weight
                member.wide_weight = None
            member.layer.__dict__.pop("forward", None)  # back to the class's forward
            member.layer.lora_group = None
        self._input = self._hidden = self._wide_x = self._wide_buffer = self._factors = None
        self._extended = False
        self.attached = False


def _multiple_of(n: int, step: int) -> int:
    return -(-n // step) * step


def wide_input(layer: nn.Module, shape, device) -> Fp8Rows | torch.Tensor | None:
    """Where the input of `layer` (shape `(..., in)`) should be written for a K-extended LoRA (`h3gen.lora.wide`):
    the `out` to hand the kernel producing it (`Fp8Rows` of e4m3 rows for an FP8 layer, else a tensor in its
    compute dtype; either a column slice of a wider buffer), then to pass to the layer and the others of its group;
    None when `layer` carries no K-extended group (the producer allocates as usual)."""
    group = getattr(layer, "lora_group", None)
    return group.wide_input(shape, device) if group is not None and group.wide else None


def attach_group(members: list[tuple[nn.Module, list[LoraFactors]]], device) -> LoraGroup:
    """`LoraGroup.build(members, device).attach()`."""
    return LoraGroup.build(members, device).attach()


def detach_all(groups: list[LoraGroup]) -> None:
    for group in groups:
        group.detach()


# ---------------------------------------------------------------------- merging


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    weight = getattr(layer, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or not weight.is_floating_point()
        or weight.dtype.itemsize < 2
        or getattr(layer, "fp8", False)
        or hasattr(layer, "weight_packed")
    ):
        raise ValueError(
            f"cannot merge a LoRA into a {type(layer).__name__} (its weights are not dense floats); apply it unmerged."
        )
    return weight


def merge_delta(layer: nn.Module, factors: list[LoraFactors]) -> torch.Tensor:
    """The float32 update `sum scale * B A` of this rank's part of `layer`'s weight, on the weight's device."""
    weight = _dense_weight(layer)
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for f in factors:
        down, up = shard_factors(layer, f.down, f.up)
        delta.addmm_(up.to(weight.device, torch.float32), down.to(weight.device, torch.float32), alpha=f.scale)
    return delta


def rounding_loss(weight: torch.Tensor, delta: torch.Tensor) -> float:
    """Share of `delta` (by norm) that adding it to `weight` in the weight's own dtype would lose to rounding:
    `|round(W + delta) - W - delta| / |delta|` (0 for a float32 weight and a representable update, 1 when the sum
    rounds back to W everywhere)."""
    base = weight.detach().float()
    kept = (base + delta).to(weight.dtype).float() - base
    norm = delta.norm()
    return float((kept - delta).norm() / norm) if norm > 0 else 0.0


def merge_factors(layer: nn.Module, delta: torch.Tensor) -> None:
    """Add a `merge_delta` result into `layer`'s weight in place (rounded to the weight's dtype)."""
    weight = _dense_weight(layer)
    with torch.no_grad():
        weight.copy_((weight.float() + delta).to(weight.dtype))
