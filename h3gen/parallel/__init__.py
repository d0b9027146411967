"""Tensor parallel x Ulysses sequence parallel on torch.distributed (NCCL on GPUs, gloo on CPUs)."""

from h3gen.parallel.state import ParallelState, init_parallel, valid_degrees

__all__ = ["ParallelState", "init_parallel", "valid_degrees"]
