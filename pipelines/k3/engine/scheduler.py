"""The K3 serving engine (`K3Engine`): a request queue, a scheduler with continuous batching and chunked prefill over
one memory pool, the radix prefix cache, sampling and streamed output (each request's state and text: `request`).

One `step()`:
1. admit waiting requests while the pool has room (a KDA slot, the first chunk's pages), taking what the prefix
   cache holds for their prompt;
2. run prefill chunks (one sequence per forward, at most `prefill_budget` tokens per step); a chunk stops at
   `chunk_size` boundaries and at the prompt's fork point from the cache, where KDA checkpoints are taken;
3. run one decode forward for every request past its prefill, whatever its length (ragged paged MLA decode).
   With decode graphs, a batch of requests that stays unchanged has its next step launched before this step's
   tokens are read (fed on the device: the graph's argmax, or tokens drawn on the device), so the GPU does not
   wait for the host.

Requests join and leave the running batch at every step. When the pool is full the scheduler first evicts prefix
cache leaves, then preempts the most recently admitted request (its memory is freed; it goes back to the front of
the queue and later recomputes its prompt plus the tokens it has produced, with the same sampler state). A request
that could never fit the pool is refused when added. Errors in one request finish that request, not the engine.
"""

import itertools

import torch

from h3gen.errors import RequestError
from h3gen.pipelines.k3.engine.batch import BatchCache, LatentView
from h3gen.pipelines.k3.engine.graphs import DecodeGraphs, capture_blocker, prepare_for_decode
from h3gen.pipelines.k3.engine.pool import MemoryPool
from h3gen.pipelines.k3.engine.radix import RadixCache
from h3gen.pipelines.k3.engine.request import (
    DECODE,
    FINISHED,
    PREFILL,
    WAITING,
    InFlightDecode,
    Request,
    RequestOutput,
)
from h3gen.pipelines.k3.engine.sampling import SamplingParams, sample, sample_on_device


class K3Engine:
    """Serve a `K3ForCausalLM`: `add_request` then `step` until done, or `generate` for a list of prompts.

    `pool_bytes` sizes the one buffer for MLA pages and KDA slots (default: room for `max_batch` sequences of
    `max_context` tokens plus as much again for the prefix cache). `cuda_graphs` (default: on a CUDA device) runs
    decode steps on static buffers captured as CUDA graphs (`engine/graphs.py`); True on a CPU runs that same
    path eagerly. On a GPU the model is prepared for decoding either way (`prepare_for_decode`: experts stacked,
    projections fused, values unchanged): without it every decode step would route its tokens expert by expert
    from the host."""

    def __init__(
        self,
        model,
        tokenizer=None,
        pool_bytes: int | None = None,
        page_size: int = 16,
        chunk_size: int = 256,
        max_batch: int = 32,
        prefill_budget: int | None = None,
        prefix_cache: bool = True,
        max_context: int = 4096,
        device=None,
        cuda_graphs: bool | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.page_size, self.chunk_size, self.max_batch = page_size, chunk_size, max_batch
        self.prefill_budget = prefill_budget or chunk_size
        self.max_context = max_context
        if pool_bytes is None:
            probe = MemoryPool(config, self.dtype, "meta", 0, page_size)
            per_seq = -(-max_context // page_size) * probe.page_bytes + 2 * probe.slot_bytes
            pool_bytes = 2 * max_batch * per_seq
        self.pool = MemoryPool(config, self.dtype, self.device, pool_bytes, page_size)
        self.cache = RadixCache(self.pool) if prefix_cache else None
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and capture_blocker(page_size, self.pool.uses_pages) is None
        if self.device.type == "cuda":  # stacked experts and fused projections, with or without graphs
            prepare_for_decode(model)
        self.graphs = (
            DecodeGraphs(model, self.pool, max_batch, -(-max_context // page_size), self.device)
            if cuda_graphs
            else None
        )
        self.num_layers = config.num_hidden_layers
        eos = config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self._ids = itertools.count()
        self.stats = dict(prefill_tokens=0, decode_tokens=0, cached_tokens=0, preemptions=0, steps=0)
        self._in_flight: InFlightDecode | None = None  # a decode step launched before its predecessor's tokens

    # ----------------------------------------------------------------- requests
    def accepts_images(self) -> bool:
        return getattr(self.model, "vision_tower", None) is not None

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, images=None) -> Request:
        """Queue one request. `images` is the `ProcessedImages` of the prompt's images (`K3ImageProcessor`), whose
        `<|media_pad|>` spans the prompt already holds (`K3Tokenizer.expand_images`). Raises `RequestError` for what
        can never be served (empty prompt, ids out of the vocabulary, a prompt plus `max_tokens` larger than the
        pool, images for a model without a vision tower)."""
        params = (params or SamplingParams()).validate()
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise RequestError("the prompt is empty.", "prompt")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab}).", "prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the context limit of {self.max_context} tokens.",
                "max_tokens",
            )
        if not self.pool.fits_alone(-(-total // self.page_size), 1):
            raise RequestError(
                f"prompt plus max_tokens ({total} tokens) does not fit this engine's memory pool "
                f"({self.pool.capacity} bytes).",
                "max_tokens",
            )
        if images and not self.accepts_images():
            raise RequestError("this K3 model has no vision tower, so it cannot take images.", "image")
        request = Request(next(self._ids), prompt_ids, params, images if images else None)
        request.generator = params.generator(self.device)
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._release(request, donate=False)
            self.running.remove(request)
        request.status, request.finish_reason = FINISHED, request.finish_reason or "abort"

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Admit, prefill, decode once. Returns an output for every request that produced text or finished."""
        self.stats["steps"] += 1
        outputs: dict[int, RequestOutput] = {}
        self._admit(outputs)
        budget = self.prefill_budget
        for request in [r for r in self.running if r.status == PREFILL]:
            if budget <= 0:
                break
            if request.status != PREFILL:  # preempted while an older request grew
                continue
            budget -= self._prefill_chunk(request, budget, outputs)
        decoding = [r for r in self.running if r.status == DECODE]
        if decoding:
            self._decode(decoding, outputs)
        for request in [r for r in self.running if r.status == FINISHED]:
            self.running.remove(request)
        return list(outputs.values())

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        images: list | None = None,
    ) -> list[Request]:
        """Run `prompts` to completion together; the finished requests, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        requests = [
            self.add_request(p, sp, None if images is None else images[i])
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        while any(r.status != FINISHED for r in requests):
            self.step()
        return requests

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None, images: list | None = None):
        """Yield `RequestOutput`s of one request as they come (other queued requests progress too)."""
        request = self.add_request(prompt_ids, params, images)
        while request.status != FINISHED:
            for output in self.step():
                if output.request_id == request.id:
                    yield output

    # ----------------------------------------------------------------- memory
    def _pages_for(self, request: Request, length: int) -> int:
        if not self.pool.uses_pages:
            return 0
        return max(0, -(-length // self.page_size) - len(request.pages))

    def _make_room(self, pages: int, slots: int, keep: Request | None) -> bool:
        """Free memory until `pages` and `slots` can be allocated: evict cache leaves, then preempt the newest
        running request other than `keep` (requests admitted earlier always win). False if impossible."""
        while not self.pool.can_allocate(pages, slots):
            if self.cache is not None and self.cache.evict_one():
                continue
            pending = [r for r in self.running if r.checkpoints]
            if pending:  # checkpoints not yet in the cache are optional
                for slot in pending[-1].checkpoints.values():
                    self.pool.free_slot(slot)
                pending[-1].checkpoints = {}
                continue
            victims = [r for r in self.running if r is not keep and r.status != FINISHED]
            if keep is not None and victims and self.running.index(victims[-1]) < self.running.index(keep):
                return False  # only older requests are left: `keep` waits, they do not
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _grow(self, request: Request, length: int) -> bool:
        need = self._pages_for(request, length)
        if need and not self._make_room(need, 0, request):
            return False
        for _ in range(need):
            request.pages.append(self.pool.alloc_page())
        return True

    def _release(self, request: Request, donate: bool) -> None:
        """Give a request's memory back; with `donate`, its tokens, pages and state go to the prefix cache."""
        if donate and self.cache is not None and request.images is None and request.computed > 0:
            checkpoints = dict(request.checkpoints)
            if request.slot is not None:
                checkpoints[request.computed] = request.slot
            self.cache.insert(request.all_ids[: request.computed], request.pages, checkpoints)
        else:
            for slot in request.checkpoints.values():
                self.pool.free_slot(slot)
            if request.slot is not None:
                self.pool.free_slot(request.slot)
        for page in request.pages:
            self.pool.decref(page)
        request.pages, request.slot, request.checkpoints = [], None, {}

    def _preempt(self, request: Request) -> None:
        self._release(request, donate=False)
        self.running.remove(request)
        request.status, request.computed = WAITING, 0
        request.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.insert(0, request)

    # ----------------------------------------------------------------- admission
    def _admit(self, outputs: dict) -> None:
        """Start waiting requests in order while the pool holds their first chunk (evicting cache leaves, never
        preempting running requests for a new one). A request the pool can never hold fails into `outputs`."""
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            ids = request.all_ids
            while True:
                hit = None
                if self.cache is not None and request.images is None:
                    hit = self.cache.match(ids, len(ids) - 1)
                resume = hit.resume if hit else 0
                first = min(len(ids), resume + self.chunk_size)
                pages = -(-first // self.page_size) - resume // self.page_size
                if self.pool.can_allocate(pages, 1):
                    break
                if self.cache is None or not self.cache.evict_one():
                    if not self.running:  # nothing will free memory: drop optional checkpoints, else give up
                        self._fail(request, RuntimeError("the memory pool is too small for this request"), outputs)
                        self.waiting.pop(0)
                        break
                    return  # waits for running requests to free memory
            if request.status == FINISHED:
                continue
            self.waiting.pop(0)
            self._start(request, hit)

    def _evict_for(self, pages: int, slots: int) -> bool:
        while not self.pool.can_allocate(pages, slots):
            if self.cache is None or not self.cache.evict_one():
                return False
        return True

    def _start(self, request: Request, hit) -> None:
        ids = request.all_ids
        request.target, request.computed, request.fork = len(ids), 0, 0
        if self.pool.uses_slots:
            request.slot = self.pool.alloc_slot()
        if hit is not None and hit.resume > 0:
            whole = hit.resume // self.page_size
            for page in hit.pages[:whole]:
                self.pool.incref(page)
            request.pages = list(hit.pages[:whole])
            if hit.resume % self.page_size and self.pool.uses_pages:
                page = self.pool.alloc_page()  # copy on write: this request will fill the rest of the page
                self.pool.copy_rows(hit.pages[whole], page, hit.resume % self.page_size)
                request.pages.append(page)
            if hit.slot is not None:
                self.pool.copy_slot(hit.slot, request.slot)
            request.computed = hit.resume
            self.stats["cached_tokens"] += hit.resume
        if hit is not None and hit.resume < hit.matched < len(ids):
            request.fork = hit.matched
        if request.images:
            pixels = request.images.pixel_values.to(self.device, self.dtype)
            request.embeds = self.model.embed_multimodal(
                torch.tensor([request.prompt_ids], device=self.device), pixels, request.images.grid_thws.to(self.device)
            )
        request.status = PREFILL
        self.running.append(request)

    # ----------------------------------------------------------------- forwards
    def _forward(self, requests: list[Request], tokens: torch.Tensor, embeds: torch.Tensor | None):
        """One model call for `requests` (`tokens` `[B, T]`), reading and writing their pool memory."""
        cache = BatchCache(self.num_layers, self.page_size)
        starts = [r.computed for r in requests]
        tables = [r.pages for r in requests]
        for j, layer in enumerate(self.pool.mla_layers):
            cache.layers[layer] = LatentView(self.pool.layer_pages(j), tables, starts, self.page_size)
        if self.pool.uses_slots and min(starts) > 0:
            for layer, state in zip(
                self.pool.kda_layers, self.pool.read_states([r.slot for r in requests]), strict=True
            ):
                cache.layers[layer] = state
        logits = self.model(None if embeds is not None else tokens, cache, inputs_embeds=embeds)
        if self.pool.uses_slots:
            self.pool.write_states([r.slot for r in requests], cache.kda_states(self.pool.kda_layers))
        return logits[:, -1]

    def _prefill_chunk(self, request: Request, budget: int, outputs: dict) -> int:
        start = request.computed
        end = min(request.target, start + budget, (start // self.chunk_size + 1) * self.chunk_size)
        if start < request.fork < end:
            end = request.fork
        if not self._grow(request, end):
            if request is self.running[0]:  # the oldest request cannot grow: the pool cannot serve it
                self._fail(request, RuntimeError("the memory pool is full"), outputs)
            return 0  # waits for memory; older requests go first
        ids = request.all_ids
        tokens = torch.tensor([ids[start:end]], device=self.device)
        embeds = None
        if request.embeds is not None:  # images: the prompt's embeddings, then (after a preemption) its output's
            done = request.embeds.shape[1]
            embeds = request.embeds[:, start:end]
            if end > done:
                extra = self.model.embed(torch.tensor([ids[max(start, done) : end]], device=self.device))
                embeds = torch.cat([embeds, extra], dim=1) if start < done else extra
        try:
            logits = self._forward([request], tokens, embeds)
        except Exception as error:  # one bad request must not stop the engine
            self._fail(request, error, outputs)
            return end - start
        request.computed = end
        self.stats["prefill_tokens"] += end - start
        if (
            self.cache is not None
            and request.images is None
            and self.pool.uses_slots
            and end < request.target
            and (end % self.chunk_size == 0 or end == request.fork)
        ):
            self._snapshot(request)
        if end == request.target:
            if self.cache is not None and request.images is None:
                if self.pool.uses_slots:
                    self._snapshot(request)
                self.cache.insert(ids[:end], request.pages, request.checkpoints)
                request.checkpoints = {}
            request.status = DECODE
            self._accept(request, sample(logits, [request.params], [request.generator])[0], outputs)
        return end - start

    def _snapshot(self, request: Request) -> None:
        """Copy the request's KDA state into a fresh slot as a checkpoint at `computed` (skipped when full)."""
        slot = self.pool.alloc_slot()
        if slot is None and self.cache is not None and self._evict_for(0, 1):
            slot = self.pool.alloc_slot()
        if slot is None:
            return
        self.pool.copy_slot(request.slot, slot)
        request.checkpoints[request.computed] = slot

    def _decode(self, requests: list[Request], outputs: dict) -> None:
        step = self._take_in_flight()
        if step is None:
            ready = []
            for request in requests:  # oldest first, so memory goes to the requests admitted earliest
                if request.status != DECODE:
                    continue
                if self._grow(request, request.computed + 1):
                    ready.append(request)
                elif request is self.running[0]:
                    self._fail(request, RuntimeError("the memory pool is full"), outputs)
            ready = [r for r in ready if r.status == DECODE]  # growing a later one may have preempted none of these
            if not ready:
                return
            if self.graphs is None or len(ready) > self.graphs.max_batch:
                self._decode_eagerly(ready, outputs)
                return
            try:
                rows = [self.pool.slot_row(r.slot) if r.slot is not None else 0 for r in ready]
                launch = self.graphs.launch(
                    [r.token_at(r.computed) for r in ready], rows, [r.pages for r in ready], [r.computed for r in ready]
                )
            except Exception as error:  # the ready requests fail; the engine goes on
                for request in ready:
                    self._fail(request, error, outputs)
                return
            step = InFlightDecode(launch, ready, [(r.computed, r.preemptions) for r in ready])
        if self._can_launch_ahead(step, requests):
            ready = step.requests
            feed = step.launch.argmax
            if any(r.params.temperature != 0.0 for r in ready):  # drawn on the device, the host reads them later
                feed = sample_on_device(
                    step.launch.logits, [r.params for r in ready], [r.generator for r in ready], step.launch.argmax
                )
                step.launch.fetch(feed)
            self._in_flight = self._launch_next(step, feed)
            chosen = step.launch.tokens()
        else:
            chosen = step.sample_valid()
        for request, mark, token in zip(step.requests, step.marks, chosen, strict=True):
            if not step.still_valid(request, mark):
                continue  # finished, aborted or preempted since the step was launched: its token is dropped
            self.stats["decode_tokens"] += 1
            request.computed += 1
            self._accept(request, token, outputs)

    def _decode_eagerly(self, ready: list[Request], outputs: dict) -> None:
        try:
            tokens = torch.tensor([[r.token_at(r.computed)] for r in ready], device=self.device)
            logits = self._forward(ready, tokens, None)
        except Exception as error:  # the ready requests fail; the engine goes on
            for request in ready:
                self._fail(request, error, outputs)
            return
        self.stats["decode_tokens"] += len(ready)
        for request in ready:
            request.computed += 1
        chosen = sample(logits, [r.params for r in ready], [r.generator for r in ready])
        for request, token in zip(ready, chosen, strict=True):
            self._accept(request, token, outputs)

    def _take_in_flight(self) -> "InFlightDecode | None":
        """The step launched ahead at the last decode, if any of its requests can still take its token."""
        step, self._in_flight = self._in_flight, None
        if step is None or not any(step.still_valid(r, m) for r, m in zip(step.requests, step.marks, strict=True)):
            return None
        return step

    def _can_launch_ahead(self, step: "InFlightDecode", decoding: list[Request]) -> bool:
        """Whether the step after `step` can be launched before `step`'s tokens are read (they are then fed on the
        device: the argmax, or tokens drawn on the device), so the GPU does not idle while the host accepts tokens
        and stages the next step. Only while nothing changes: `step`'s requests are all that run, none reaches
        `max_tokens` with it, nothing waits to be admitted, and their next rows' pages are free without evicting or
        preempting. A request that stops (EOS, a stop string) after `step` has had one token too many computed; its
        result is dropped and its memory is not donated to the prefix cache (`_finish`)."""
        ready = step.requests
        if (
            self.graphs is None
            or self.waiting
            or len(self.running) != len(ready)
            or {id(r) for r in decoding if r.status == DECODE} != {id(r) for r in ready}
        ):
            return False
        if any(
            not step.still_valid(r, m)
            or len(r.output_ids) + 1 >= r.params.max_tokens
            or r.computed + 2 > self.max_context
            for r, m in zip(ready, step.marks, strict=True)
        ):
            return False
        need = sum(self._pages_for(r, r.computed + 2) for r in ready)
        return not need or self.pool.can_allocate(need, 0)

    def _launch_next(self, step: "InFlightDecode", feed: torch.Tensor) -> "InFlightDecode | None":
        """Launch the step after `step` with its tokens `feed` `[n]` on the device (see `_can_launch_ahead`)."""
        ready = step.requests
        for request in ready:
            for _ in range(self._pages_for(request, request.computed + 2)):
                request.pages.append(self.pool.alloc_page())
        rows = [self.pool.slot_row(r.slot) if r.slot is not None else 0 for r in ready]
        try:
            launch = self.graphs.launch(feed, rows, [r.pages for r in ready], [r.computed + 1 for r in ready])
        except Exception:  # the step is decoded the ordinary way next time
            return None
        return InFlightDecode(launch, ready, [(r.computed + 1, r.preemptions) for r in ready])

    # ----------------------------------------------------------------- output
    def _accept(self, request: Request, token: int, outputs: dict) -> None:
        request.output_ids.append(token)
        params = request.params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            request.output_ids.pop()
            request.finish_reason = "stop"
            token = None
        elif len(request.output_ids) >= params.max_tokens:
            request.finish_reason = "length"
        if self.tokenizer is not None:
            request.text = request.text_after(self.tokenizer, token)
            for stop in params.stop:
                where = request.text.find(stop)
                if where >= 0:
                    request.text, request.finish_reason = request.text[:where], "stop"
        if request.finish_reason is not None:
            self._finish(request)
        self._emit(request, outputs)

    def _emit(self, request: Request, outputs: dict) -> None:
        """Record the request's output of this step. A request can take two tokens in one step (its prefill's
        last chunk, then a decode): the step's output then carries both deltas."""
        output = request.take_output()
        earlier = outputs.get(request.id)
        if earlier is not None:
            output.delta = earlier.delta + output.delta
        outputs[request.id] = output

    def _finish(self, request: Request) -> None:
        # A step launched ahead may be computing one more token for it: its memory then holds more than its
        # tokens say, so it is not offered to the prefix cache.
        ahead = self._in_flight is not None and any(r is request for r in self._in_flight.requests)
        self._release(request, donate=not ahead)
        request.status = FINISHED

    def _fail(self, request: Request, error: Exception, outputs: dict) -> None:
        request.error = f"{type(error).__name__}: {error}"
        request.finish_reason = "error"
        self._release(request, donate=False)
        request.status = FINISHED
        self._emit(request, outputs)
