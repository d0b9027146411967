"""Run options: how a model is loaded and run (quality tier, offload, GPU budget, prefetch, weight quantization,
workflow, attention backend), validated once.

The allowed values and the rules that combine them live here only; the CLI's choices and help, the REST schema's
enums, the UI's choices, the server's engine and `H3Pipeline` all read them from this module. Every invalid value
raises a `RequestError` naming the field and what is allowed.
"""

from dataclasses import dataclass, fields, replace

from h3gen.errors import RequestError
from h3gen.kernels.attention_backends import BACKENDS as ATTENTION_BACKENDS

# Each allowed value with the one line of help every face shows for it.
QUALITY_HELP = {
    "exact": "the reference op order",
    "lossless": "the same math through fused kernels, bf16-level differences",
    "fast": "FP8 GEMMs and attention, an approximation with measured error",
    "high": "lossless plus a first-block step cache: forwards whose first block changes little reuse the other "
    "blocks' last output (an approximation; knobs: cache)",
    "fast+high": "fast plus the same step cache",
}
# Tiers that add the first-block step cache (pipelines/h3/step_cache.py) to a base tier, per request.
CACHED_TIERS = {"high": "lossless", "fast+high": "fast"}
OFFLOAD_HELP = {
    "none": "everything stays on the device",
    "stage": "the text encoder and the VAEs visit the device only for their stage",
    "layerwise": "stage, plus transformer blocks streamed from pinned host memory within gpu_memory",
}
QUANTIZATION_HELP = {
    "mxfp4": "store the transformer's block linears as MXFP4 (quantized while loading)",
}
TASK_HELP = {
    "t2va": "text only",
    "fl2va": "first and/or last keyframe",
    "ref2va": "reference images, videos and sounds",
}
WORKFLOW_HELP = {
    "auto": "all when both transformer partitions take under a quarter of the device's memory, else t2va + fl2va",
    "all": "every task the checkpoint holds (ref2va loads the transformer_ref/ partition as well)",
    "t2va": "t2va only",
    "fl2va": "t2va and fl2va (one transformer partition)",
    "ref2va": "ref2va only (the transformer_ref/ partition)",
}

QUALITY_TIERS = tuple(QUALITY_HELP)
OFFLOAD_MODES = tuple(OFFLOAD_HELP)
QUANTIZATIONS = tuple(QUANTIZATION_HELP)
TASKS = tuple(TASK_HELP)
WORKFLOWS = tuple(WORKFLOW_HELP)
# Attention backends that quantize q/k/v: an approximation, so only the fast tier may name them.
APPROXIMATE_ATTENTION = tuple(name for name in ATTENTION_BACKENDS if name.endswith("-fp8"))

GiB = 2**30
_BYTE_UNITS = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "kib": 2**10, "kb": 10**3, "b": 1}


def describe(help_by_value: dict[str, str]) -> str:
    """ "value: help; value: help" for a help line (argparse, the REST schema)."""
    return "; ".join(f"{value}: {text}" for value, text in help_by_value.items())


def check_choice(field: str, value, allowed: tuple, *, optional: bool = False) -> None:
    """Raise a `RequestError` naming `field` unless `value` is one of `allowed` (or None when `optional`)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or value not in allowed:
        unset = " (or unset)" if optional else ""
        raise RequestError(f"{field} must be one of {', '.join(allowed)}{unset} (got {value!r}).", field)


def base_tier(tier: str) -> str:
    """The tier whose kernels and weights `tier` runs on: `high` -> lossless, `fast+high` -> fast, else itself."""
    return CACHED_TIERS.get(tier, tier)


def uses_step_cache(tier: str | None) -> bool:
    """Whether `tier` adds the first-block step cache."""
    return tier in CACHED_TIERS


def parse_bytes(text: str | int | float | None) -> int | None:
    """ "30GiB", "24GB", "512MiB" or a number of bytes -> bytes (None stays None)."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else int(text)
    value = text.strip().lower().replace(" ", "")
    for unit, factor in _BYTE_UNITS.items():
        if value.endswith(unit):
            try:
                return int(float(value[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(float(value))
    except ValueError:
        raise RequestError(f"gpu_memory must look like 30GiB, 24GB or 512MiB (got {text!r}).", "gpu_memory") from None


@dataclass(frozen=True)
class RunOptions:
    """How to load and run a model. Validated on construction; `RequestError` names the field and the allowed values.

    quality: "exact", "lossless" (default), "fast", "high" or "fast+high", see `QUALITY_HELP`. "fast" quantizes the
        block GEMMs to FP8 at load, so a model loaded for it serves only fast and fast+high requests, and only it
        serves them (`request_quality`). "high" loads as lossless and "fast+high" as fast; either is then the tier
        of the requests that name none.
    offload: "none" (default), "stage" or "layerwise", see `OFFLOAD_HELP`.
    gpu_memory: what the transformer may use on the GPU under layer-wise offload ("30GiB", "24GB", bytes); needed
        by "layerwise", unused otherwise.
    prefetch: transformer blocks copied ahead under layer-wise offload, at least 1 (default 2).
    quantization: None (the weights as stored) or "mxfp4".
    workflow: the tasks to load for, see `WORKFLOW_HELP` (default "t2va").
    attention: an attention backend for the lossless and fast tiers instead of the tier's own choice (None,
        the default); the exact tier always runs torch's SDPA choice, as diffusers does, and the FP8 backends
        (`APPROXIMATE_ATTENTION`) belong to the fast tier.
    """

    quality: str = "lossless"
    offload: str = "none"
    gpu_memory: str | int | None = None
    prefetch: int = 2
    quantization: str | None = None
    workflow: str = "t2va"
    attention: str | None = None

    def __post_init__(self):
        check_choice("quality", self.quality, QUALITY_TIERS)
        check_choice("offload", self.offload, OFFLOAD_MODES)
        check_choice("quantization", self.quantization, QUANTIZATIONS, optional=True)
        check_choice("workflow", self.workflow, WORKFLOWS)
        check_choice("attention", self.attention, ATTENTION_BACKENDS, optional=True)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise RequestError(
                f"prefetch must be a whole number of blocks, at least 1 (got {self.prefetch!r}).", "prefetch"
            )
        if self.gpu_memory is not None and (parse_bytes(self.gpu_memory) or 0) <= 0:
            raise RequestError(f"gpu_memory must be more than 0 bytes (got {self.gpu_memory!r}).", "gpu_memory")
        if self.offload == "layerwise" and self.gpu_memory is None:
            raise RequestError("offload='layerwise' needs gpu_memory, e.g. '30GiB'.", "gpu_memory")
        base = base_tier(self.quality)
        if self.attention is not None and base == "exact":
            raise RequestError(
                f"attention {self.attention} cannot be combined with quality exact, which runs torch's "
                "SDPA choice as the reference does; leave attention unset or pick quality "
                "lossless or fast.",
                "attention",
            )
        if self.attention in APPROXIMATE_ATTENTION and base != "fast":
            raise RequestError(
                f"attention {self.attention} quantizes q/k/v to FP8, an approximation for quality "
                f"fast only (quality is {self.quality}).",
                "attention",
            )

    @classmethod
    def merged(cls, options: "RunOptions | None" = None, **keywords) -> "RunOptions":
        """`options` (default `RunOptions()`) with every keyword that is not None put in its place: how the
        keyword arguments of `H3Pipeline.from_pretrained`, `H3Engine` and the CLI flags become one object."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(keywords) - names)
        if unknown:
            raise TypeError(f"unknown run options {', '.join(unknown)}; known: {', '.join(sorted(names))}.")
        given = {name: value for name, value in keywords.items() if value is not None}
        return replace(options or cls(), **given)

    @property
    def gpu_memory_bytes(self) -> int | None:
        """`gpu_memory` in bytes (None when unset)."""
        return parse_bytes(self.gpu_memory)

    def request_quality(self, requested: str | None) -> str:
        """The tier one request runs at: `requested`, or this model's own when None. exact, lossless and high
        switch freely; fast and fast+high need a model loaded with quality fast or fast+high, which serves only
        those two."""
        tier = self.quality if requested is None else requested
        check_choice("quality", tier, QUALITY_TIERS)
        if (base_tier(tier) == "fast") != (base_tier(self.quality) == "fast"):
            raise RequestError(
                f"quality {tier} is not available here: fast and fast+high need a model loaded with quality fast or "
                "fast+high (its block weights are FP8; --quality fast on the command line), and such a model serves "
                f"only fast and fast+high requests (loaded: {self.quality}).",
                "quality",
            )
        return tier

    def servable_tiers(self) -> tuple[str, ...]:
        """Every tier `request_quality` accepts on this model."""
        fast = base_tier(self.quality) == "fast"
        return tuple(tier for tier in QUALITY_TIERS if (base_tier(tier) == "fast") == fast)

    def attention_for(self, tier: str) -> str | None:
        """The attention backend to run a tier with: `attention` for lossless and fast, None (the tier's own
        choice) otherwise or when unset."""
        return None if base_tier(tier) == "exact" else self.attention
