"""Layer-wise offload of transformer blocks: pinned host copies, a copy stream that prefetches into a ring of GPU
buffers, and per-slot events so compute waits only for the block it needs and a copy never overwrites a slot
still in use.

Each streamed block's tensors are packed into one flat buffer per dtype, in host memory (pinned on CUDA) and in
each of the `slots` GPU buffers; before a block runs, its parameters are pointed at views of the slot holding it,
and afterwards at an empty placeholder, so nothing else keeps the slot alive. Blocks are fetched in forward order
with a sequence counter that runs across steps, so the next step's first blocks are already in flight while this
step's last ones compute.

A pass (one forward through the blocks) may end early: the first-block step cache (`pipelines/h3/step_cache.py`)
skips the blocks after block 0 on a cached step. It calls `hold_next_pass()` when the next pass may end that way, so
none of that pass's copies but block 0's is issued until it calls `release()` (the pass goes on) or `end_pass()`
(it stopped after block 0): a skipped block is never copied.

Sub-modules named in `on_demand` (the AdaLN projection, whose tables the lossless tier computes once per request)
are not streamed every step and do not stay on the GPU, in resident blocks either: they are copied in,
synchronously, only when they are called (every step under the exact tier, which projects AdaLN in each forward).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from h3gen.offload.residency import OffloadPlan


@dataclass
class _Slot:
    """Where one tensor of a packed module lives inside the flat per-dtype buffers."""

    module: nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype
    offset: int
    shape: torch.Size


def owned_tensors(module: nn.Module, skip: tuple[str, ...]):
    """(owner module, attribute name, is parameter, tensor) for every parameter and buffer under `module`, except
    those under sub-modules whose name (relative to `module`) is in `skip`."""
    for sub_name, sub in module.named_modules():
        if any(sub_name == s or sub_name.startswith(s + ".") for s in skip):
            continue
        for name, tensor in sub._parameters.items():
            if tensor is not None:
                yield sub, name, True, tensor
        for name, tensor in sub._buffers.items():
            if tensor is not None:
                yield sub, name, False, tensor


def packed_sizes(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[torch.dtype, int]:
    """Elements per dtype a `PackedModule` of `module` holds (works on the meta device)."""
    sizes: dict[torch.dtype, int] = {}
    for *_, tensor in owned_tensors(module, skip):
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return sizes


class PackedModule:
    """One module's tensors packed into flat host buffers, one per dtype; `bind` points the module at a copy.

    `host` gives the buffers (e.g. views of a shared host store; default: new ones, pinned if `pin`); `fill=False`
    leaves them as they are, for a module whose tensors are not loaded here (meta) but packed by another process."""

    def __init__(
        self,
        module: nn.Module,
        skip: tuple[str, ...],
        pin: bool,
        host: dict[torch.dtype, torch.Tensor] | None = None,
        fill: bool = True,
    ):
        self.slots: list[_Slot] = []
        sizes: dict[torch.dtype, int] = {}
        tensors = list(owned_tensors(module, skip))
        for owner, name, is_param, tensor in tensors:
            offset = sizes.get(tensor.dtype, 0)
            self.slots.append(_Slot(owner, name, is_param, tensor.dtype, offset, tensor.shape))
            sizes[tensor.dtype] = offset + tensor.numel()
        self.sizes = sizes
        self.host = (
            host
            if host is not None
            else {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
        )
        if fill:
            for slot, (_, _, _, tensor) in zip(self.slots, tensors, strict=True):
                self.host[slot.dtype][slot.offset : slot.offset + tensor.numel()].copy_(tensor.detach().reshape(-1))

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.host.values())

    def bind(self, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        """Point every tensor of the module at its view of `buffers` (flat, per dtype)."""
        for slot in self.slots:
            _point(slot, buffers[slot.dtype][slot.offset : slot.offset + slot.shape.numel()].view(slot.shape))

    def release(self, placeholders: dict[torch.dtype, torch.Tensor]) -> None:
        """Point every tensor at an empty placeholder (the module holds no memory until bound again)."""
        for slot in self.slots:
            _point(slot, placeholders[slot.dtype])


def _move(module: nn.Module, name: str, is_param: bool, tensor: torch.Tensor) -> None:
    """Make `module.<name>` hold `tensor` (a parameter keeps its identity unless it was never loaded)."""
    if not is_param:
        module._buffers[name] = tensor
        return
    param = module._parameters[name]
    if param.device.type == "meta":  # never loaded here (a shared-store reader): a meta tensor cannot take data
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        param.data = tensor


def _point(slot: _Slot, tensor: torch.Tensor) -> None:
    _move(slot.module, slot.name, slot.is_param, tensor)


class LayerwiseOffload:
    """Streams the `plan.streamed` blocks of `blocks` through `plan.slots` GPU buffers; the resident blocks move to
    `device` for good. `copy_log`, if given, records the order of block copies (tests use it)."""

    def __init__(
        self,
        blocks: nn.ModuleList,
        plan: OffloadPlan,
        device,
        *,
        prefetch: int = 2,
        on_demand: tuple[str, ...] = ("adaln_proj",),
        pin: bool | None = None,
        copy_log: list | None = None,
        host_store=None,
    ):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        pin = cuda if pin is None else pin
        self.order = list(plan.streamed)
        self.prefetch = max(1, min(prefetch, len(self.order) - 1)) if len(self.order) > 1 else 0
        self.slots = min(plan.slots or (self.prefetch + 1), len(self.order)) if self.order else 0
        self.copy_log = copy_log
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        units = {("block", i): (blocks[i], on_demand) for i in self.order}
        # The on-demand parts of every block, resident ones included, stay on the host: the planner's budget
        # leaves them out.
        units |= {
            (i, name): (getattr(blocks[i], name), ())
            for i in self.order + list(plan.resident)
            for name in on_demand
            if hasattr(blocks[i], name)
        }
        self.host_store = host_store
        if host_store is None:
            for index in plan.resident:
                for owner, name, is_param, tensor in owned_tensors(blocks[index], on_demand):
                    _move(owner, name, is_param, tensor.to(self.device))
            packed = {key: PackedModule(module, skip, pin) for key, (module, skip) in units.items()}
        else:
            # Every block goes through the shared store (resident ones too: a reader rank never loaded them), laid
            # out identically on every rank; the owner fills it, the readers only map it.
            units |= {("resident", i): (blocks[i], on_demand) for i in plan.resident}
            hosts = host_store.allocate([packed_sizes(module, skip) for module, skip in units.values()])
            packed = {
                key: PackedModule(module, skip, pin, host=host, fill=host_store.owner)
                for (key, (module, skip)), host in zip(units.items(), hosts, strict=True)
            }
            host_store.publish()
            for i in plan.resident:
                resident = packed.pop(("resident", i))
                resident.bind({dtype: host.to(self.device) for dtype, host in resident.host.items()})
        self.packed = {i: packed[("block", i)] for i in self.order}
        self.on_demand = {key: value for key, value in packed.items() if key[0] != "block"}
        dtypes = {dtype for p in list(self.packed.values()) + list(self.on_demand.values()) for dtype in p.sizes}
        self.placeholders = {dtype: torch.empty(0, dtype=dtype, device=self.device) for dtype in dtypes}
        for packed in list(self.packed.values()) + list(self.on_demand.values()):
            packed.release(self.placeholders)
        largest = {dtype: max((p.sizes.get(dtype, 0) for p in self.packed.values()), default=0) for dtype in dtypes}
        self.ring = [
            {dtype: torch.empty(n, dtype=dtype, device=self.device) for dtype, n in largest.items() if n}
            for _ in range(self.slots)
        ]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(self.slots)]
        self.computed = [torch.cuda.Event() if cuda else None for _ in range(self.slots)]
        self.position = {block_index: p for p, block_index in enumerate(self.order)}
        self.computing = 0  # sequence number (across steps) of the next streamed block to compute
        self.issued = 0  # sequence number of the next copy to issue
        self.pass_start = 0  # sequence number of the running pass's first streamed block
        self.held: int | None = None  # the pass_start of a held pass (see `hold_next_pass`)
        self.first_streamed = int(bool(self.order) and self.order[0] == 0)  # whether block 0 itself streams
        self.handles = []
        if self.order:  # first among block 0's hooks: a pass begins
            self.handles.append(blocks[0].register_forward_pre_hook(self._pass_begins))
        for i in self.order:
            self.handles.append(blocks[i].register_forward_pre_hook(self._before(i)))
            self.handles.append(blocks[i].register_forward_hook(self._after(i)))
        for (i, name), packed in self.on_demand.items():
            # Hooked where the weights are used (the AdaLN projection is reached through a method, not forward).
            for sub in getattr(blocks[i], name).modules():
                if any(t is not None for t in sub._parameters.values()):
                    self.handles.append(sub.register_forward_pre_hook(self._load_now(packed)))
                    self.handles.append(sub.register_forward_hook(self._unload(packed)))

    # ------------------------------------------------------------------ copies

    def _issue(self, sequence: int) -> None:
        slot = sequence % self.slots
        block = self.order[sequence % len(self.order)]
        if self.copy_log is not None:
            self.copy_log.append(block)
        packed = self.packed[block]
        if self.copy_stream is None:
            for dtype, host in packed.host.items():
                self.ring[slot][dtype][: host.numel()].copy_(host)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.computed[slot])  # the slot's previous block has finished computing
            for dtype, host in packed.host.items():
                self.ring[slot][dtype][: host.numel()].copy_(host, non_blocking=True)
            self.copied[slot].record(self.copy_stream)

    def _resync(self, position: int) -> None:
        """The forward did not follow the planned order (e.g. an error stopped a step midway): drain the copies
        and start over at `position`."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self.computing = self.issued = position
        self.held = None

    def _issue_ahead(self, needed: bool) -> None:
        """Issue copies up to `prefetch` blocks ahead of the one computing next, except those of a held pass after
        its block 0; with `needed`, the block computing next is issued in any case."""
        limit = None if self.held is None else self.held + self.first_streamed
        while self.issued <= self.computing + self.prefetch:
            if limit is not None and self.issued >= limit and not (needed and self.issued == self.computing):
                break
            self._issue(self.issued)
            self.issued += 1

    def _pass_begins(self, module, args):
        if self.computing % len(self.order):  # the last pass stopped midway (an error): start over
            self._resync(0)
        self.pass_start = self.computing
        self._issue_ahead(needed=False)

    # ------------------------------------------------------------------ passes that end early

    def hold_next_pass(self) -> None:
        """The pass after the running one may end after block 0: issue none of its later copies until `release()`
        or `end_pass()`."""
        if self.order:
            self.held = self.pass_start + len(self.order)

    def release(self) -> None:
        """Whatever pass was held goes on: its copies are issued from its next block on, as usual."""
        self.held = None

    def end_pass(self) -> None:
        """The running pass stops after the blocks it has run (the rest are skipped)."""
        if not self.order:
            return
        end = self.pass_start + len(self.order)
        if self.issued > self.computing:  # copies in flight that no block will use
            self._resync(end)
        self.computing = self.issued = end

    def _before(self, index: int):
        def hook(module, args):
            if self.computing % len(self.order) != self.position[index]:
                self._resync(self.position[index])
            self._issue_ahead(needed=True)
            slot = self.computing % self.slots
            if self.copied[slot] is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
            self.packed[index].bind(self.ring[slot])

        return hook

    def _after(self, index: int):
        def hook(module, args, output):
            slot = self.computing % self.slots
            if self.computed[slot] is not None:
                self.computed[slot].record(torch.cuda.current_stream(self.device))
            self.packed[index].release(self.placeholders)
            self.computing += 1

        return hook

    def _load_now(self, packed: PackedModule):
        def hook(module, args):
            packed.bind({dtype: host.to(self.device, non_blocking=True) for dtype, host in packed.host.items()})

        return hook

    def _unload(self, packed: PackedModule):
        def hook(module, args, output):
            packed.release(self.placeholders)

        return hook

    # ------------------------------------------------------------------ reports

    @property
    def pinned_bytes(self) -> int:
        """Host bytes holding the streamed weights (with a shared store: the whole store, once per machine)."""
        if self.host_store is not None:
            return self.host_store.nbytes
        return sum(p.nbytes for p in list(self.packed.values()) + list(self.on_demand.values()))

    @property
    def ring_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for slot in self.ring for b in slot.values())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
