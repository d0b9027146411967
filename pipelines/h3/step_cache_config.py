"""The first-block step cache's per-request knobs (`cache` of a request), their ranges, defaults and help: what
every face validates and shows, without importing torch. `step_cache.py` holds the rule that uses them."""

from dataclasses import dataclass
from typing import Mapping

from h3gen.errors import RequestError

# The per-request knobs, their allowed ranges (inclusive) and defaults: the anchors' H3 values.
THRESHOLD_RANGE = (0.0, 1.0)
WARMUP_RANGE = (0, 1000)
MAX_CONSECUTIVE_RANGE = (1, 1000)
DEFAULT_THRESHOLD, DEFAULT_WARMUP, DEFAULT_MAX_CONSECUTIVE = 0.04, 4, 1
CACHE_FIELDS = ("threshold", "warmup", "max_consecutive")
CACHE_HELP = {
    "threshold": f"relative L1 change of block 0's residual below which a forward is cached, "
    f"{THRESHOLD_RANGE[0]:g} to {THRESHOLD_RANGE[1]:g} (0 never caches, 1 caches every forward the "
    f"other rules allow; default {DEFAULT_THRESHOLD:g})",
    "warmup": f"first forwards always computed, {WARMUP_RANGE[0]} to {WARMUP_RANGE[1]} (default {DEFAULT_WARMUP})",
    "max_consecutive": f"most cached forwards in a row, {MAX_CONSECUTIVE_RANGE[0]} to {MAX_CONSECUTIVE_RANGE[1]} "
    f"(default {DEFAULT_MAX_CONSECUTIVE})",
}


def _number(field: str, value, low, high, *, integer: bool):
    kind = "a whole number" if integer else "a number"
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if not integer else int)
    if integer and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or not low <= value <= high:
        raise RequestError(f"cache.{field} must be {kind} from {low:g} to {high:g} (got {value!r}).", f"cache.{field}")
    return value


@dataclass(frozen=True)
class StepCacheConfig:
    """The step cache's knobs, validated on construction (`RequestError` naming `cache.<field>` and its range)."""

    threshold: float = DEFAULT_THRESHOLD
    warmup: int = DEFAULT_WARMUP
    max_consecutive: int = DEFAULT_MAX_CONSECUTIVE

    def __post_init__(self):
        object.__setattr__(
            self, "threshold", float(_number("threshold", self.threshold, *THRESHOLD_RANGE, integer=False))
        )
        object.__setattr__(self, "warmup", _number("warmup", self.warmup, *WARMUP_RANGE, integer=True))
        object.__setattr__(
            self,
            "max_consecutive",
            _number("max_consecutive", self.max_consecutive, *MAX_CONSECUTIVE_RANGE, integer=True),
        )

    @classmethod
    def from_request(cls, cache: "Mapping | StepCacheConfig | None") -> "StepCacheConfig":
        """A request's `cache` value: None (the defaults), a `StepCacheConfig`, or a mapping with any of
        `threshold`, `warmup`, `max_consecutive` (missing ones take the defaults)."""
        if cache is None:
            return cls()
        if isinstance(cache, cls):
            return cache
        if not isinstance(cache, Mapping):
            raise RequestError(
                f"cache must be an object with {', '.join(CACHE_FIELDS)} (got {type(cache).__name__}).", "cache"
            )
        unknown = sorted(str(key) for key in cache if key not in CACHE_FIELDS)
        if unknown:
            raise RequestError(f"cache takes {', '.join(CACHE_FIELDS)} only (got {', '.join(unknown)}).", "cache")
        return cls(**{key: value for key, value in cache.items() if value is not None})
