"""Running diffusers' own MiniMax-H3 ModularPipeline on a checkpoint folder: the reference our pipeline must equal."""

import warnings
from unittest import mock

import torch


def reference_processor(folder):
    """A Qwen3VLProcessor for the tiny checkpoint without torchvision: PIL image processor, no video processor
    (the reference doc's workaround; t2va and image keyframes never touch the video processor)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, argument):
        return None if name == "video_processor" else original(self, name, argument)

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check):
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(f"{folder}/processor"),
            tokenizer=AutoTokenizer.from_pretrained(f"{folder}/tokenizer"),
            video_processor=None,
        )


def load_reference(folder, workflow: str = "t2va", dtype=torch.float32):
    from diffusers import ModularPipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = ModularPipeline.from_pretrained(str(folder), workflow=workflow)
        names = [n for n in pipe.component_names if n not in ("processor", "video_processor", "image_processor")]
        pipe.load_components(names=names, torch_dtype=dtype)
        pipe.update_components(processor=reference_processor(folder))
    return pipe


def run_reference(pipe, prompt: str, seed: int, **kwargs):
    """-> (video (F, H, W, 3) float32 numpy, audio (2, N) float32 numpy, latents, audio_latents)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np",
                   output=["videos", "audio", "latents", "audio_latents"], **kwargs)
    return out["videos"][0], out["audio"][0].numpy(), out["latents"], out["audio_latents"]
