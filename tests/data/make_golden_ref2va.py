"""Writes golden_ref2va.npz: outputs of the real torchaudio and torchvision + transformers that h3gen's own
torchvision-free ref2va code must reproduce (tests/test_ref2va.py).

    TORCHAUDIO_DIR=<torchaudio 2.11 unpacked> PYTHONPATH=<dir with torchvision 0.28 unpacked> \
        python tests/data/make_golden_ref2va.py

Only the pure-Python parts are used (`torchaudio.functional` resampling, `torchvision.transforms.v2.functional`
resize/normalize). The wheels on the dev machine's registry are CUDA builds whose native extensions do not load next
to torch 2.13.0+cpu, so the import skips those extensions; the ops used here never call them.
"""

import importlib
import sys
from pathlib import Path

import numpy as np
import torch


def _torchaudio_resampling():
    """torchaudio's two resampling functions, executed from its source (its package init needs the native
    extension; these two functions do not)."""
    import ast
    import math
    import os
    import warnings
    from typing import Optional

    path = Path(os.environ["TORCHAUDIO_DIR"]) / "torchaudio" / "functional" / "functional.py"
    tree = ast.parse(path.read_text())
    wanted = {"_get_sinc_resample_kernel", "_apply_sinc_resample_kernel"}
    module = ast.Module([node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted], [])
    namespace = {
        "math": math,
        "torch": torch,
        "Tensor": torch.Tensor,
        "Optional": Optional,
        "warnings": warnings,
        "_CPU": torch.device("cpu"),
    }
    exec(compile(module, str(path), "exec"), namespace)
    return namespace["_get_sinc_resample_kernel"], namespace["_apply_sinc_resample_kernel"]


def _import_torchvision_without_native_extensions():
    original = torch._C._dispatch_has_kernel_for_dispatch_key

    def tolerant(name, key):
        try:
            return original(name, key)
        except RuntimeError:
            return False

    torch._C._dispatch_has_kernel_for_dispatch_key = tolerant
    try:
        importlib.import_module("torchvision")  # registers the v2 functional ops transformers calls
    finally:
        torch._C._dispatch_has_kernel_for_dispatch_key = original


RESAMPLE_CASES = [
    (44100, 32000, 883),
    (48000, 32000, 961),
    (16000, 32000, 403),
    (22050, 32000, 441),
    (8000, 32000, 199),
]
VIDEO_CASES = [((5, 33, 47), {}), ((3, 70, 40), {}), ((4, 64, 96), {"longest_edge": 8192}), ((2, 45, 80), {})]


def main(out: Path) -> None:
    get_kernel, apply_kernel = _torchaudio_resampling()
    _import_torchvision_without_native_extensions()
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from h3gen.pipelines.h3.tiny_checkpoint import video_processor_config

    rng = np.random.default_rng(2024)
    data = {}
    for index, (orig, new, length) in enumerate(RESAMPLE_CASES):
        wave = rng.standard_normal((2, length)).astype(np.float32) * 0.3
        gcd = int(np.gcd(orig, new))
        kernel, width = get_kernel(orig, new, gcd)  # what `torchaudio.transforms.Resample(orig, new)` holds
        out_wave = apply_kernel(torch.from_numpy(wave), orig, new, gcd, kernel, width)
        data[f"resample{index}_rates"] = np.array([orig, new])
        data[f"resample{index}_in"] = wave
        data[f"resample{index}_out"] = out_wave.numpy()
    for index, (shape, size) in enumerate(VIDEO_CASES):
        config = video_processor_config()
        config["size"] = {**config["size"], **size}
        config.pop("video_processor_type"), config.pop("processor_class")
        processor = Qwen3VLVideoProcessor(**config)
        video = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        features = processor(videos=[video], do_sample_frames=False, return_tensors="pt")
        values = features["pixel_values_videos"].numpy()
        recovered = np.round(values * 127.5 + 127.5)
        assert np.abs(recovered - (values * 127.5 + 127.5)).max() < 1e-3  # mean = std = 0.5: exactly invertible
        data[f"video{index}_in"] = video
        data[f"video{index}_longest_edge"] = np.array(config["size"]["longest_edge"])
        data[f"video{index}_pixels"] = recovered.astype(np.uint8)
        data[f"video{index}_grid"] = features["video_grid_thw"].numpy()
    np.savez_compressed(out, **data)


if __name__ == "__main__":
    main(Path(__file__).with_name("golden_ref2va.npz"))
