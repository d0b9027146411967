"""One memory pool for a K3 engine: MLA latent pages grow from the bottom, KDA state slots from the top.

The pool is one byte buffer. A *page* holds `page_size` latent rows `[c_kv | k_pe]` of every MLA layer
(`[mla_layers, page_size, row_dim]` in the model dtype); a *slot* holds the whole fixed-size KDA state of one
sequence for every KDA layer (`[kda_layers, conv + recurrent]` float32). Page `p` sits at byte `p * page_bytes`,
slot `s` ends `s * slot_bytes` below the top, so a traffic of long prompts takes pages and a traffic of many short
requests or many prefix checkpoints takes slots, from the same bytes. The two high-water marks may not cross.

Pages are reference counted (a page may be shared by running requests and prefix-cache nodes); a slot has one
owner (a running request, or a prefix-cache checkpoint) and is copied, never shared.
"""

import heapq

import torch

from h3gen.pipelines.k3.cache import KDAState
from h3gen.pipelines.k3.config import K3Config


class _Stack:
    """Indices handed out lowest first from one end of the pool; `high` is one past the highest in use."""

    def __init__(self):
        self.high = 0
        self.free: set[int] = set()  # free indices below `high`
        self._heap: list[int] = []

    def take(self) -> int:
        """The lowest free index below `high`, else a new one at `high` (the caller checked there is room)."""
        while self._heap:
            index = heapq.heappop(self._heap)
            if index in self.free:
                self.free.discard(index)
                return index
        self.high += 1
        return self.high - 1

    def give(self, index: int) -> None:
        self.free.add(index)
        heapq.heappush(self._heap, index)
        while self.high and self.high - 1 in self.free:  # shrink so the other end can grow
            self.high -= 1
            self.free.discard(self.high)

    @property
    def used(self) -> int:
        return self.high - len(self.free)


class MemoryPool:
    """MLA pages (bottom up) and KDA state slots (top down) in one buffer of `capacity_bytes`."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device, capacity_bytes: int, page_size: int = 16):
        self.page_size = page_size
        self.dtype = dtype
        self.mla_layers = [i for i, t in enumerate(config.attention_types) if t == "mla"]
        self.kda_layers = [i for i, t in enumerate(config.attention_types) if t == "kda"]
        self.row_dim = config.kv_lora_rank + config.qk_rope_head_dim
        heads, head_dim = config.linear_num_heads, config.linear_head_dim
        self.conv_shape = (config.conv_kernel_size - 1, 3 * heads * head_dim)
        self.recurrent_shape = (heads, head_dim, head_dim)
        self.conv_floats = self.conv_shape[0] * self.conv_shape[1]
        state_floats = self.conv_floats + heads * head_dim * head_dim
        element = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = len(self.mla_layers) * page_size * self.row_dim * element
        self.slot_bytes = len(self.kda_layers) * state_floats * 4
        self.capacity = capacity_bytes // 4 * 4
        self.storage = torch.zeros(self.capacity, dtype=torch.uint8, device=device)
        self.max_pages = self.capacity // self.page_bytes if self.page_bytes else 0
        self.max_slots = self.capacity // self.slot_bytes if self.slot_bytes else 0
        # Views over the whole buffer; which parts are live is the allocators' business.
        self.pages = (
            self.storage[: self.max_pages * self.page_bytes]
            .view(dtype)
            .view(self.max_pages, len(self.mla_layers), page_size, self.row_dim)
        )
        self.slots = (
            self.storage[self.capacity - self.max_slots * self.slot_bytes :]
            .view(torch.float32)
            .view(self.max_slots, len(self.kda_layers), state_floats)
        )
        self._pages, self._slots = _Stack(), _Stack()
        self.page_refs: dict[int, int] = {}

    # ----------------------------------------------------------------- accounting
    @property
    def uses_pages(self) -> bool:
        return bool(self.mla_layers)

    @property
    def uses_slots(self) -> bool:
        return bool(self.kda_layers)

    def _gap(self) -> int:
        return self.capacity - self._pages.high * self.page_bytes - self._slots.high * self.slot_bytes

    def can_allocate(self, pages: int = 0, slots: int = 0) -> bool:
        pages = pages if self.uses_pages else 0
        slots = slots if self.uses_slots else 0
        gap = self._gap()
        extra_slots = max(0, slots - len(self._slots.free))
        gap -= extra_slots * self.slot_bytes
        extra_pages = max(0, pages - len(self._pages.free))
        return gap >= 0 and gap >= extra_pages * self.page_bytes

    def fits_alone(self, pages: int, slots: int) -> bool:
        """Whether an empty pool could hold this much (admission control for requests that can never run)."""
        need = (pages if self.uses_pages else 0) * self.page_bytes + (slots if self.uses_slots else 0) * self.slot_bytes
        return need <= self.capacity

    def usage(self) -> dict:
        return dict(
            pages_used=self._pages.used,
            slots_used=self._slots.used,
            capacity_bytes=self.capacity,
            page_bytes=self.page_bytes,
            slot_bytes=self.slot_bytes,
            free_bytes=self.free_bytes(),
        )

    def free_bytes(self) -> int:
        return self._gap() + len(self._pages.free) * self.page_bytes + len(self._slots.free) * self.slot_bytes

    # ----------------------------------------------------------------- pages
    def alloc_page(self) -> int | None:
        """A fresh page (reference count 1), or None when the pool is full."""
        if not self.can_allocate(pages=1):
            return None
        index = self._pages.take()
        self.page_refs[index] = 1
        return index

    def incref(self, page: int) -> None:
        self.page_refs[page] += 1

    def decref(self, page: int) -> None:
        self.page_refs[page] -= 1
        if self.page_refs[page] == 0:
            del self.page_refs[page]
            self._pages.give(page)

    def copy_rows(self, src: int, dst: int, count: int) -> None:
        self.pages[dst, :, :count] = self.pages[src, :, :count]

    def layer_pages(self, mla_index: int) -> torch.Tensor:
        """`[max_pages, page_size, row_dim]` view of one MLA layer (the layout `mla_decode` reads)."""
        return self.pages[:, mla_index]

    # ----------------------------------------------------------------- slots
    def alloc_slot(self) -> int | None:
        if not self.can_allocate(slots=1):
            return None
        return self._slots.take()

    def free_slot(self, slot: int) -> None:
        self._slots.give(slot)

    def slot_row(self, slot: int) -> int:
        """The row of `slots` (a view of the pool) that holds `slot`."""
        return self.max_slots - 1 - slot  # slot 0 is the topmost

    def copy_slot(self, src: int, dst: int) -> None:
        self.slots[self.slot_row(dst)] = self.slots[self.slot_row(src)]

    def read_states(self, slots: list[int]) -> list[KDAState]:
        """The KDA states of `slots`, batched in that order: one `KDAState` per KDA layer (copies)."""
        rows = self.slots[[self.slot_row(s) for s in slots]]  # [B, L, F]
        out = []
        for layer in range(len(self.kda_layers)):
            conv, recurrent = rows[:, layer].split([self.conv_floats, rows.shape[-1] - self.conv_floats], dim=-1)
            out.append(
                KDAState(
                    conv.reshape(len(slots), *self.conv_shape), recurrent.reshape(len(slots), *self.recurrent_shape)
                )
            )
        return out

    def write_states(self, slots: list[int], states: list[KDAState]) -> None:
        rows = torch.tensor([self.slot_row(s) for s in slots], device=self.storage.device)
        for layer, state in enumerate(states):
            packed = torch.cat([state.conv.reshape(len(slots), -1), state.recurrent.reshape(len(slots), -1)], dim=-1)
            self.slots[rows, layer] = packed.float()
