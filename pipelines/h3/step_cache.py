"""First-block step cache (`quality="high"`): on a denoising forward where the first block changes its input about
as much as it did on the last fully computed forward, skip blocks 1..N-1 and reuse what they added then.

The rule (Cache-DiT's DBCache with Fn = 1, Bn = 0, TaylorSeer off, as SGLang and vLLM-Omni configure it for H3):

- Block 0 always runs. Its residual `r = block_0(x) - x` (over this rank's rows of the whole packed sequence: text,
  conditioning, audio and video rows alike, so they share one decision) is compared with the residual of the last
  *computed* forward by relative L1: `diff = sum |r - r_prev| / sum |r_prev|`.
- A forward is cached when all of these hold: it is not one of the first `warmup` forwards; it is not the last
  forward of the request; fewer than `max_consecutive` forwards in a row right before it were cached; and
  `diff < threshold` (strictly). `threshold` 0 never caches; `threshold` 1 caches every forward the other
  conditions allow, whatever the diff (Cache-DiT's meaning of 0 and >= 1).
- A cached forward adds the stored tail residual (last block's output minus block 0's output, from the last
  computed forward) to block 0's output and goes on to `norm_out` and the heads. A computed forward stores its
  block-0 residual and its tail residual.

Where this differs from Cache-DiT (and so from SGLang, which mounts Cache-DiT):
- Cache-DiT's run counter is not advanced by a cached forward that does not directly follow another cached one (only
  by the very first), so with `max_continuous_cached_steps=1` it caches runs of two (C F C C F C C ...). Here
  `max_consecutive` is what its name says: at most that many cached forwards in a row (C F C F ...).
- Cache-DiT may cache the last forward; here it is always computed, since its velocity lands in the output with no
  later step to correct it.
- Under sequence parallelism Cache-DiT averages each rank's mean (pad rows included); here each rank sums over its
  real rows and the sums are added over the ranks that hold different rows, so the diff is the one-process value.
  Tensor-parallel ranks hold the same rows; their decisions are made to agree by a minimum over the TP group.

Under layer-wise offload (`h3gen.offload.LayerwiseOffload`) a forward that may be cached holds back the copies of
its blocks after block 0 until the decision: a cached forward copies no block but block 0 (none when block 0 is
resident), and a computed one starts copying block 1 only once block 0 has run.
"""

from contextlib import contextmanager
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from h3gen.pipelines.h3.step_cache_config import StepCacheConfig


class StepCache:
    """The decision state of one request: which forwards are cached, the stored residuals, the diffs measured.

    Args:
        config: the knobs.
        num_forwards: transformer forwards in the request (the last one is always computed).
        parallel: the model's `ParallelState` (None on one process).
        shard: the model's `SequenceShard` under Ulysses (its pad rows are left out of the diff).
        stream: the model's `LayerwiseOffload` (None when the blocks are resident).
        forced: for tests and benchmarks: one decision per forward (True = cached) replacing the rule's; the diff
            is still measured and recorded. Forcing a cache before any forward was computed is an error.
    """

    def __init__(
        self,
        config: StepCacheConfig,
        num_forwards: int,
        *,
        parallel=None,
        shard=None,
        stream=None,
        forced: Sequence[bool] | None = None,
    ):
        if forced is not None and len(forced) != num_forwards:
            raise ValueError(f"forced holds {len(forced)} decisions for {num_forwards} forwards.")
        self.config = config
        self.num_forwards = num_forwards
        self.parallel = parallel
        self.shard = shard
        self.stream = stream if hasattr(stream, "hold_next_pass") else None
        self.forced = list(forced) if forced is not None else None
        self.step = 0  # the next forward's index
        self.consecutive = 0  # cached forwards in a row right before `step`
        self.residual: torch.Tensor | None = None  # block 0's residual at the last computed forward
        self.tail: torch.Tensor | None = None  # last block's output minus block 0's, same forward
        self.cached_steps: list[int] = []
        self.diffs: list[float | None] = []  # per forward: the diff measured, None where none was

    # ------------------------------------------------------------------ the rule

    def may_cache(self, step: int) -> bool:
        """Whether forward `step` can be cached at all (the diff aside), given the forwards before it."""
        if self.forced is not None:
            return bool(self.forced[step])
        return (
            self.config.threshold > 0
            and step >= self.config.warmup
            and step < self.num_forwards - 1
            and self.consecutive < self.config.max_consecutive
            and self.residual is not None
        )

    def decide(self, step: int, diff: float | None) -> bool:
        """Whether forward `step` is cached, given its measured diff (None when not measured)."""
        if self.forced is not None:
            if self.forced[step] and self.residual is None:
                raise ValueError(f"forced cache at forward {step}, before any forward was computed.")
            return bool(self.forced[step])
        if not self.may_cache(step):
            return False
        return self.config.threshold >= 1.0 or (diff is not None and diff < self.config.threshold)

    def _relative_l1(self, residual: torch.Tensor) -> float:
        """sum |r - r_prev| / sum |r_prev| over the real rows of the whole sequence (all ranks)."""
        rows = residual.shape[1]
        if self.shard is not None and self.parallel is not None:  # trailing pad rows on the last ranks
            rows = max(0, min(rows, self.shard.valid - self.parallel.sp_rank * self.shard.local))
        current, previous = residual[:, :rows], self.residual[:, :rows]
        sums = torch.stack(
            [
                (current - previous).abs().sum(dtype=torch.float32).double(),
                previous.abs().sum(dtype=torch.float32).double(),
            ]
        )
        if self.parallel is not None and self.parallel.sp_group is not None:
            dist.all_reduce(sums, group=self.parallel.sp_group)
        numerator, denominator = sums.tolist()
        return numerator / denominator if denominator > 0 else float("inf")

    def _agree(self, cached: bool) -> bool:
        """Tensor-parallel ranks hold the same rows; make sure they take the same branch."""
        if self.parallel is None or self.parallel.tp_group is None:
            return cached
        flag = torch.tensor([int(cached)], device=self.residual.device if self.residual is not None else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.parallel.tp_group)
        return bool(flag.item())

    # ------------------------------------------------------------------ the forward

    def run_blocks(
        self,
        num_blocks: int,
        x: torch.Tensor,
        run_block: Callable[[int, torch.Tensor], torch.Tensor],
        first_block: torch.nn.Module,
    ) -> torch.Tensor:
        """One forward's block stack: `run_block(i, x)` runs block i (which may update `x` in place, as the fused
        tiers do) and `first_block` is block 0's module (its input is read as block 0 receives it: after the
        sequence-parallel cut). Returns the stack's output `(B, S_local, hidden)`."""
        step = self.step
        if step >= self.num_forwards:
            raise RuntimeError(
                f"the step cache was set up for {self.num_forwards} forwards; this is forward {step + 1}."
            )
        if num_blocks == 0:
            self.step += 1
            return x
        seen = {}

        def keep_input(module, args, kwargs):
            seen["input"] = args[0].clone()

        handle = first_block.register_forward_pre_hook(keep_input, with_kwargs=True)
        try:
            x = run_block(0, x)
        finally:
            handle.remove()
        block_input = seen.pop("input")
        residual = torch.sub(x, block_input, out=block_input)
        allowed = self.may_cache(step)
        diff = None
        if self.residual is not None and (allowed or self.forced is not None):
            diff = self._relative_l1(residual)
        cached = self.decide(step, diff)
        if allowed and self.forced is None:
            cached = self._agree(cached)
        self.diffs.append(diff)
        self.step += 1
        if cached:
            self.consecutive += 1
            self.cached_steps.append(step)
            self._plan_stream(cached=True)
            return x.add_(self.tail)
        self.consecutive = 0
        self.residual = residual
        self.tail = None  # its memory back before this forward's blocks run
        self._plan_stream(cached=False)
        first_output = x.clone()
        for index in range(1, num_blocks):
            x = run_block(index, x)
        self.tail = torch.sub(x, first_output, out=first_output)
        return x

    def _plan_stream(self, cached: bool) -> None:
        """Tell layer-wise offload how this forward goes on and whether the next one may end after block 0."""
        if self.stream is None:
            return
        if cached:
            self.stream.end_pass()
        if self.step < self.num_forwards and self.may_cache(self.step):
            self.stream.hold_next_pass()
        else:
            self.stream.release()

    @property
    def computed_steps(self) -> list[int]:
        """Forwards run so far that were computed (all blocks)."""
        cached = set(self.cached_steps)
        return [step for step in range(self.step) if step not in cached]


@contextmanager
def step_cache(transformer, config: StepCacheConfig, num_forwards: int, *, forced: Sequence[bool] | None = None):
    """Attach a fresh `StepCache` to `transformer` (an `H3Transformer`) for one request's `num_forwards` forwards;
    yields it. Detached afterwards, and layer-wise offload released, however the request ends."""
    cache = StepCache(
        config,
        num_forwards,
        parallel=getattr(transformer, "parallel_state", None),
        shard=getattr(transformer, "sequence_shard", None),
        stream=getattr(transformer, "offload", None),
        forced=forced,
    )
    transformer.step_cache = cache
    try:
        yield cache
    finally:
        transformer.step_cache = None
        if cache.stream is not None:
            cache.stream.release()
