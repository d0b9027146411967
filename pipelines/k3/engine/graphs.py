"""Decode steps on static buffers, captured as CUDA graphs.

A decode step launches over a thousand small kernels; launched one by one from Python they take many times the
GPU time the step needs. Here the whole decode forward of a batch of `size` sequences reads its inputs from fixed
device buffers (token ids, each sequence's KDA slot row, block table and length), so it can be captured once per
batch size and replayed: a batch of n runs as the smallest captured size >= n, the extra rows pointing at a
scratch page and a scratch slot that the runner keeps for itself.

Inside the forward nothing synchronises with the host: the fused KDA decode op updates each sequence's states where
they lie in the pool (rows picked by device indices; padding rows share the scratch slot, whose contents nobody
reads), MLA rows are written through the device block table, the paged MLA decode kernel reads lengths on the
device, and MoE layers route on the device over stacked experts (`expert_gemv` per pair, or blocks per expert for
larger batches). On a CPU the same forward runs eagerly (no capture), which is how tests check it against the
ordinary path; `bench_k3.py --check` checks it on a GPU.
"""

import torch

from h3gen.pipelines.k3.cache import KDAState
from h3gen.pipelines.k3.engine.batch import BatchCache


class StaticLatentView:
    """One MLA layer's rows for a decode batch, addressed through device tensors: `table` `[B, W]` int32 page ids and
    `lens` `[B]` int32 rows before this step. The new row of sequence b goes to position `lens[b]`."""

    length = 1  # what the model reads as "rows before this call": > 0 selects the absorbed decode path

    def __init__(
        self,
        pages: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        page_size: int,
        lens_after: torch.Tensor | None = None,
    ):
        self.pages, self.table, self.lens, self.page_size = pages, table, lens, page_size
        self.lens_after = lens + 1 if lens_after is None else lens_after  # shared by a step's MLA layers

    def append(self, rows: torch.Tensor) -> None:
        """`rows` `[B, 1, D]`."""
        position = self.lens.long()
        page = self.table.long().gather(1, (position // self.page_size)[:, None])[:, 0]
        self.pages[page, position % self.page_size] = rows[:, 0].to(self.pages.dtype)

    def normed_row_write(self, latent: torch.Tensor, k_pe: torch.Tensor, norm) -> tuple:
        """The `append` of `[norm(latent), k_pe]` (`[B, 1, r]`, `[B, 1, d_r]`, `norm` a `K3RMSNorm`) left undone:
        the arguments of `write_latent_rows` for it, which the model hands to the absorbed query's op
        (`absorb_query(..., new_rows=)`), so the write needs no kernel of its own."""
        return latent[:, 0], k_pe[:, 0], norm.weight, norm.eps, self.pages, self.table, self.lens

    def block_table(self) -> torch.Tensor:
        return self.table

    def seq_lens(self) -> torch.Tensor:
        return self.lens_after

    def rows(self) -> torch.Tensor:
        raise RuntimeError("a static decode batch has no expanded-attention path")


class DecodeBuffers:
    """The fixed inputs and outputs of one captured batch size. The inputs are views of one device byte buffer
    (int64: token ids, state rows; int32: block table, lengths) filled by one copy from a pinned host twin, so a
    step costs the host one copy and no device kernels before the replay. `lens_after` (`lens` + 1, what the MLA
    layers attend over once the step's row is written) comes from the host too, not from a kernel in the step.
    The step's argmax is written over its token ids (read by then): a greedy step fed on the device finds its ids
    in place, and its copy leaves them out."""

    def __init__(self, size: int, max_pages: int, device):
        device = torch.device(device)
        self.size, self.width = size, max(1, max_pages)
        id_bytes = 2 * size * 8  # int64 ids first: the int32 positions after them stay aligned
        self.raw = torch.zeros(id_bytes + 4 * size * (self.width + 2), dtype=torch.uint8, device=device)
        self.ids = self.raw[:id_bytes].view(torch.long)
        self.positions = self.raw[id_bytes:].view(torch.int32)
        self.tokens = self.ids[:size].view(size, 1)
        self.state_rows = self.ids[size:]
        self.table = self.positions[: size * self.width].view(size, self.width)
        self.lens = self.positions[size * self.width : size * (self.width + 1)]
        self.lens_after = self.positions[size * (self.width + 1) :]
        pinned = device.type == "cuda"
        self.host_raw = torch.zeros(self.raw.shape, dtype=torch.uint8, pin_memory=pinned)
        self.host_ids = self.host_raw[:id_bytes].view(torch.long)
        self.host_positions = self.host_raw[id_bytes:].view(torch.int32)
        self.copied: torch.cuda.Event | None = None  # the last host-to-device copy
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None  # [size] the logits' argmax (a view of the token ids' buffer)
        # Two host buffers for a step's chosen tokens, used in turn: they are read while the next step runs.
        self.host_tokens = [torch.zeros(size, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.turn = 0

    def stage(
        self,
        tokens: list[int],
        state_rows: list[int],
        tables: list[list[int]],
        lens: list[int],
        scratch_row: int,
        scratch_page: int,
        keep_tokens: bool = False,
    ) -> None:
        """Write a step's inputs (rows beyond `len(tokens)` pointed at the scratch slot and page) and copy them to
        the device; with `keep_tokens`, all but the token ids (the device's are the step's: the previous step's
        argmax). Table entries past a sequence's pages are left as they were: nothing reads them."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have left the host buffers
        count, size = len(tokens), self.size
        ids, positions = self.host_ids.numpy(), self.host_positions.numpy()
        ids[:count], ids[count:size] = tokens, 0
        ids[size : size + count], ids[size + count :] = state_rows, scratch_row
        table = positions[: size * self.width].reshape(size, self.width)
        for b, pages in enumerate(tables):
            table[b, : len(pages)] = pages
        table[count:, 0] = scratch_page
        lens_start, after_start = size * self.width, size * (self.width + 1)
        positions[lens_start : lens_start + count] = lens
        positions[lens_start + count : after_start] = 0
        positions[after_start:] = positions[lens_start:after_start] + 1
        start = 8 * size if keep_tokens else 0
        self.raw[start:].copy_(self.host_raw[start:], non_blocking=True)
        if self.ids.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


def static_decode_forward(model, pool, buffers: DecodeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode forward of `buffers.size` sequences: (logits `[size, vocab]`, their argmax `[size]` int64);
    updates their pool memory in place."""
    size = buffers.size
    cache = BatchCache(model.config.num_hidden_layers, pool.page_size)
    for j, layer in enumerate(pool.mla_layers):
        cache.layers[layer] = StaticLatentView(
            pool.layer_pages(j), buffers.table, buffers.lens, pool.page_size, buffers.lens_after
        )
    given = []
    if pool.uses_slots:  # each KDA layer's states where they lie in the pool, the batch's rows picked on the device
        slots = pool.slots.shape[0]
        for j, layer in enumerate(pool.kda_layers):
            conv, recurrent = pool.slots[:, j].split(
                [pool.conv_floats, pool.slots.shape[-1] - pool.conv_floats], dim=-1
            )
            given.append(
                KDAState(
                    conv.view(slots, *pool.conv_shape),
                    recurrent.view(slots, *pool.recurrent_shape),
                    rows=buffers.state_rows,
                )
            )
            cache.layers[layer] = given[-1]
    # the argmax over the token ids: a following step fed on the device reads them there
    logits, argmax = model(buffers.tokens, cache, argmax_into=buffers.ids[:size])
    if pool.uses_slots:
        for j, (new, old) in enumerate(zip(cache.kda_states(pool.kda_layers), given, strict=True)):
            if new is not old:  # a layer that returned new states instead of updating its rows (not the decode op)
                packed = torch.cat([new.conv.reshape(size, -1), new.recurrent.reshape(size, -1)], dim=-1)
                pool.slots[:, j].index_copy_(0, buffers.state_rows, packed.float())
    return logits[:, -1], argmax[:, -1]


def prepare_for_decode(model) -> None:
    """Stack each MoE layer's experts and fuse the projections that read the same input (weights re-pointed into
    shared tensors, values unchanged; see `K3MoE.stack_experts`, `fuse_linears`): fewer, larger GEMMs per step."""
    for module in model.modules():
        if hasattr(module, "stack_experts"):
            module.stack_experts()
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()


def batch_sizes(max_batch: int) -> list[int]:
    """The captured sizes: powers of two below `max_batch`, and `max_batch`."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


def capture_blocker(page_size: int, uses_pages: bool) -> str | None:
    """Why the decode forward cannot be captured as a CUDA graph; None when it can (dense and MXFP4 experts both
    can: on the H200 the graphed float32 engine gives the torch reference's greedy tokens with either)."""
    if uses_pages and (page_size < 16 or page_size & (page_size - 1)):
        return f"CUDA-graph decode needs a power-of-two page size >= 16 for the MLA decode kernel (got {page_size})"
    return None


class DecodeGraphs:
    """Runs decode steps of up to `max_batch` sequences on static buffers: captured as CUDA graphs (one per size in
    `batch_sizes`, on first use) on a CUDA device, eagerly elsewhere. Takes one page and one slot of the pool as
    scratch for padding rows, and stacks the MoE experts of `model` (see `K3MoE.stack_experts`)."""

    def __init__(self, model, pool, max_batch: int, max_pages: int, device):
        self.model, self.pool, self.device = model, pool, torch.device(device)
        self.max_pages = max_pages
        self.sizes = batch_sizes(max_batch)
        self.capture = self.device.type == "cuda"
        if self.capture and (reason := capture_blocker(pool.page_size, pool.uses_pages)):
            raise ValueError(reason)
        prepare_for_decode(model)
        page = pool.alloc_page() if pool.uses_pages else 0
        slot = pool.alloc_slot() if pool.uses_slots else 0
        if page is None or slot is None:
            raise RuntimeError("the memory pool has no room for the decode graphs' scratch page and slot")
        self.scratch_page, self.scratch_row = page, pool.slot_row(slot) if pool.uses_slots else 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, DecodeBuffers]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _prepare(self, size: int) -> tuple:
        if size in self.graphs:
            return self.graphs[size]
        buffers = DecodeBuffers(size, self.max_pages, self.device)
        buffers.stage([], [], [], [], self.scratch_row, self.scratch_page)  # every row padding until used
        graph = None
        if self.capture:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            # Warm-up outside the capture, of every op the graph holds (kernel compilation, allocator pools, and
            # the kernels' arrival counters and argmax keys: one first allocated inside the capture would put its
            # zero-fill into every replay).
            with torch.cuda.stream(side):
                for _ in range(2):
                    static_decode_forward(self.model, self.pool, buffers)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                buffers.logits, buffers.argmax = static_decode_forward(self.model, self.pool, buffers)
        self.graphs[size] = (graph, buffers)
        return self.graphs[size]

    @torch.no_grad()
    def launch(
        self, tokens: list[int] | torch.Tensor, state_rows: list[int], tables: list[list[int]], lens: list[int]
    ) -> "DecodeLaunch":
        """Start one decode step for n sequences: `tokens` (their last ids: a list, or a `[n]` int64 device tensor
        such as the previous step's argmax, so the step can start before the host has read that step's tokens),
        `state_rows` (pool slot rows), `tables` (page ids), `lens` (rows already cached). Nothing here waits for
        the GPU."""
        count = len(state_rows)
        size = next(s for s in self.sizes if s >= count)
        graph, buffers = self._prepare(size)
        if any(len(t) > buffers.width for t in tables):
            raise ValueError(f"a sequence holds more than the {buffers.width} pages the decode graphs were built for")
        on_device = isinstance(tokens, torch.Tensor)
        # the previous step's own argmax (a greedy step launched ahead) is already where this step reads its ids
        in_place = (
            on_device
            and buffers.argmax is not None
            and tokens.numel() == count
            and tokens.data_ptr() == buffers.argmax.data_ptr()
        )
        buffers.stage(
            [0] * count if on_device else tokens,
            state_rows,
            tables,
            lens,
            self.scratch_row,
            self.scratch_page,
            keep_tokens=in_place,
        )
        if on_device and not in_place:  # after the staged copy, so it wins
            buffers.tokens[:count, 0].copy_(tokens)
        if graph is None:
            buffers.logits, buffers.argmax = static_decode_forward(self.model, self.pool, buffers)
        else:
            graph.replay()
        host = buffers.host_tokens[buffers.turn]
        buffers.turn ^= 1
        launched = DecodeLaunch(buffers, count, host)
        launched.fetch(launched.argmax)
        return launched

    def run(
        self, tokens: list[int], state_rows: list[int], tables: list[list[int]], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`launch` with host tokens, returning logits `[n, vocab]` and their argmax `[n]` (device tensors, valid
        until the next step of this batch size)."""
        step = self.launch(tokens, state_rows, tables, lens)
        return step.logits, step.argmax


class DecodeLaunch:
    """A decode step handed to the GPU. `logits` `[n, vocab]` and `argmax` `[n]` are device views of the batch
    size's buffers, valid until its next launch. `tokens()` reads the step's chosen tokens (its argmax, or what
    `fetch` was last given) from a host copy of its own, so they stay readable while a following step runs."""

    def __init__(self, buffers: DecodeBuffers, count: int, host: torch.Tensor):
        self.buffers, self.count, self.host = buffers, count, host
        self.logits, self.argmax = buffers.logits[:count], buffers.argmax[:count]
        self.done = None

    def fetch(self, tokens: torch.Tensor) -> None:
        """Start copying `tokens` `[n]` (int64, on the device: the step's choices) to the host; call it before the
        next step is launched, so reading them does not wait for that step."""
        self.host[: self.count].copy_(tokens, non_blocking=True)
        if tokens.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def tokens(self) -> list[int]:
        """The fetched tokens; waits for this step (not for any launched after it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host[: self.count].tolist()
