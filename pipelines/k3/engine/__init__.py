"""Serving K3: one memory pool for MLA pages and KDA states, a radix prefix cache with KDA checkpoints, a
scheduler with continuous batching and chunked prefill, and the sampler."""

from h3gen.pipelines.k3.engine.pool import MemoryPool
from h3gen.pipelines.k3.engine.radix import RadixCache
from h3gen.pipelines.k3.engine.request import Request, RequestOutput
from h3gen.pipelines.k3.engine.sampling import SamplingParams
from h3gen.pipelines.k3.engine.scheduler import K3Engine

__all__ = ["K3Engine", "MemoryPool", "RadixCache", "Request", "RequestOutput", "SamplingParams"]
