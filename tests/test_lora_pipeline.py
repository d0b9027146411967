"""LoRA through the whole pipeline against diffusers' MiniMax-H3 ModularPipeline with the same files loaded by its
own `load_lora_weights` (float32, CPU): two stacked adapters on t2va, and an adapter on ref2va, which both route to
the `transformer_ref` partition."""

import numpy as np
import pytest
import torch
from helpers.h3_reference import load_ref2va_reference, load_reference, run_ref2va_reference, run_reference
from helpers.lora_files import (
    TURBO_MODULES,
    diffusers_shapes,
    native_shapes,
    random_factors,
    write_diffusers,
    write_native,
)
from PIL import Image

from h3gen.pipelines.h3.pipeline import H3Pipeline

# Whole tiny pipelines with adapters against diffusers' and PEFT: outside the fast tier.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """A Turbo-shaped peft file and a kohya file with `.alpha` tensors over every module."""
    folder = tmp_path_factory.mktemp("loras")
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    shapes = diffusers_shapes(pipe.transformer)
    turbo = folder / "turbo.safetensors"
    write_diffusers(
        turbo,
        random_factors({k: v for k, v in shapes.items() if k.endswith(TURBO_MODULES)}, 4, 1, scale=0.5),
        peft=True,
    )
    kohya = folder / "kohya.safetensors"
    write_native(
        kohya,
        random_factors(native_shapes(pipe.config), 4, 2, scale=0.5),
        style="kohya",
        alphas={"blocks.0.attn.qkv_proj": 2.0, "blocks.1.mlp.fc1": 8.0},
    )
    return turbo, kohya


def _close(output, expected):
    video, audio, *_ = expected
    assert np.abs(output.video - video).max() <= TOLERANCE and np.abs(output.audio - audio).max() <= TOLERANCE


def test_t2va_with_two_stacked_adapters_matches_diffusers(tiny_dir, files):
    kwargs = dict(num_frames=130, num_inference_steps=3, height=64, width=96)
    reference = load_reference(tiny_dir, "t2va")
    plain = run_reference(reference, "a fox", 5, **kwargs)
    for index, path in enumerate(files):
        reference.load_lora_weights(str(path), adapter_name=f"a{index}")
    reference.set_adapters(["a0", "a1"], [0.7, 0.4])
    expected = run_reference(reference, "a fox", 5, **kwargs)
    assert np.abs(expected[0] - plain[0]).max() > 0.01  # the adapters change the clip
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32)
    output = pipe("a fox", seed=5, loras=[(str(files[0]), 0.7), (str(files[1]), 0.4)], **kwargs)
    _close(output, expected)
    assert output.loras == [("turbo", 0.7), ("kohya", 0.4)]


def test_ref2va_adapter_goes_to_transformer_ref_as_in_diffusers(tiny_dir, files, tmp_path):
    picture = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 72, 3), dtype=np.uint8)).save(picture)
    kwargs = dict(num_frames=130, num_inference_steps=3)
    reference = load_ref2va_reference(tiny_dir)
    reference.load_lora_weights(str(files[1]), adapter_name="k")  # a ref2va pipeline: into transformer_ref
    expected = run_ref2va_reference(reference, "a bird", 3, [("image", picture)], **kwargs)
    pipe = H3Pipeline.from_pretrained(tiny_dir, device="cpu", torch_dtype=torch.float32, workflow="all")
    output = pipe("a bird", references=[picture], seed=3, loras=[str(files[1])], **kwargs)
    _close(output, expected)
    assert pipe.transformer_ref.active_loras is not None and getattr(pipe.transformer, "active_loras", None) is None
