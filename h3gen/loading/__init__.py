"""Checkpoint loading: safetensors files and indexes, key layouts, streamed meta-device loading, dtype islands."""

from h3gen.loading.files import read_json, safetensors_files
from h3gen.loading.layouts import convert_key, detect_layout, to_original_layout
from h3gen.loading.load import assign_tensors, load_transformer, meta_parameters, read_tensors
from h3gen.loading.save import save_component

__all__ = [
    "assign_tensors",
    "convert_key",
    "detect_layout",
    "load_transformer",
    "meta_parameters",
    "read_json",
    "read_tensors",
    "safetensors_files",
    "save_component",
    "to_original_layout",
]
