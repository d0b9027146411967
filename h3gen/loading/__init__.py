"""Checkpoint loading for any model: safetensors files and indexes, streamed meta-device loading, dtype islands,
writing component folders. Each model's own loader (`pipelines/h3/loader.py`, `pipelines/k3/loader.py`) knows its
key layouts."""

from h3gen.loading.files import read_json, safetensors_files
from h3gen.loading.load import assign_tensors, keeps_fp32, meta_parameters, read_tensors
from h3gen.loading.save import save_component

__all__ = [
    "assign_tensors",
    "keeps_fp32",
    "meta_parameters",
    "read_json",
    "read_tensors",
    "safetensors_files",
    "save_component",
]
