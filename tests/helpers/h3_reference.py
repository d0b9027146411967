"""Running diffusers' own MiniMax-H3 ModularPipeline on a checkpoint folder: the reference our pipeline must equal."""

import enum
import sys
import types
import warnings
from unittest import mock

import torch


def reference_processor(folder):
    """A Qwen3VLProcessor for the tiny checkpoint without torchvision: PIL image processor, no video processor
    (transformers' Qwen3VLVideoProcessor needs torchvision; t2va and image keyframes never touch the video
    processor)."""
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
        out = pipe(
            prompt=prompt,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
            output=["videos", "audio", "latents", "audio_latents"],
            **kwargs,
        )
    return out["videos"][0], out["audio"][0].numpy(), out["latents"], out["audio_latents"]


# ------------------------------------------------------------------------------------------------------ ref2va
#
# diffusers' ref2va reads reference videos through transformers' `Qwen3VLVideoProcessor`, written on torchvision's
# tensor ops, and resamples reference sound with torchaudio. No CPU build of either matches torch 2.13.0+cpu on this
# machine's registry (both wheels there are CUDA builds), so for the reference run:
# - torchvision's three functional ops the processor calls (`resize`, `normalize`, `grayscale_to_rgb`) are provided
#   by `TorchvisionFunctional`, which follows torchvision 0.28's `resize_image` (uint8 bicubic antialiased runs
#   natively on the CPU) and `normalize_image`; everything else - smart_resize, grouping, fused rescale, patch
#   order - is transformers' own code. tests/data/golden_ref2va.npz holds outputs of the real torchvision +
#   transformers to pin this down;
# - `torchaudio.transforms.Resample` is h3gen's `resample_audio`, which tests/data/golden_ref2va.npz pins against
#   real torchaudio outputs. Requests with sound at 32 kHz need no resampling and exercise no substitute at all.


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class TorchvisionFunctional:
    """The slice of `torchvision.transforms.v2.functional` Qwen3-VL's video processor uses, on tensors."""

    InterpolationMode = InterpolationMode

    @staticmethod
    def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True, **_):
        shape = image.shape
        channels, height, width = shape[-3:]
        if tuple(size) == (height, width):
            return image
        if interpolation not in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
            raise NotImplementedError(interpolation)
        flat = image.reshape(-1, channels, height, width)
        native = image.dtype == torch.float32 or (
            image.dtype == torch.uint8 and interpolation == InterpolationMode.BICUBIC
        )
        work = flat if native else flat.float()
        out = torch.nn.functional.interpolate(
            work, size=list(size), mode=interpolation.value, align_corners=False, antialias=antialias
        )
        if not native:
            out = out.clamp(0, 255).round().to(image.dtype) if image.dtype == torch.uint8 else out.to(image.dtype)
        return out.reshape(*shape[:-3], channels, *size)

    @staticmethod
    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    @staticmethod
    def grayscale_to_rgb(image):
        return image if image.shape[-3] >= 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])


def _torchvision_patches():
    """Patches that let transformers' torchvision-backed processors run on `TorchvisionFunctional`."""
    import transformers.image_processing_backends as backends
    import transformers.models.qwen3_vl.video_processing_qwen3_vl as qwen_video
    import transformers.video_processing_utils as video_utils
    from transformers.image_utils import PILImageResampling

    mapping = {
        PILImageResampling.BILINEAR: InterpolationMode.BILINEAR,
        PILImageResampling.BICUBIC: InterpolationMode.BICUBIC,
    }
    return [
        mock.patch.object(module, "tvF", TorchvisionFunctional, create=True)
        for module in (backends, qwen_video, video_utils)
    ] + [mock.patch.object(backends, "pil_torch_interpolation_mapping", mapping)]


def reference_video_processor(folder):
    """transformers' own `Qwen3VLVideoProcessor` from the checkpoint's `processor/video_preprocessor_config.json`
    (call it inside `torchvision_substitute()`)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor.from_pretrained(f"{folder}/processor")


class _Resample:
    def __init__(self, orig_freq, new_freq):
        self.orig_freq, self.new_freq = orig_freq, new_freq

    def __call__(self, waveform):
        from h3gen.pipelines.h3.references import resample_audio

        return resample_audio(waveform, self.orig_freq, self.new_freq)


class torchvision_substitute:
    """Context in which transformers' video processor and diffusers' soundtrack resampling run without torchvision
    and torchaudio (see above)."""

    def __enter__(self):
        self._patches = _torchvision_patches()
        torchaudio = types.ModuleType("torchaudio")
        torchaudio.transforms = types.SimpleNamespace(Resample=_Resample)
        self._patches.append(mock.patch.dict(sys.modules, {"torchaudio": torchaudio}))
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._patches):
            patch.stop()


def load_ref2va_reference(folder, dtype=torch.float32):
    """diffusers' pipeline for workflow ref2va, its processor with transformers' video processor attached."""
    pipe = load_reference(folder, "ref2va", dtype)
    processor = reference_processor(folder)
    processor.video_processor = reference_video_processor(folder)
    pipe.update_components(processor=processor)
    return pipe


def diffusers_references(references):
    """diffusers' reference objects for (kind, payload) pairs: a path (decoded by diffusers' own `from_file`) or
    in-memory media as diffusers takes it."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    classes = {"image": MiniMaxH3ImageReference, "video": MiniMaxH3VideoReference, "audio": MiniMaxH3AudioReference}
    out = []
    for kind, payload in references:
        if isinstance(payload, dict):
            out.append(classes[kind](**payload))
        else:
            out.append(classes[kind].from_file(str(payload)))
    return out


def run_ref2va_reference(pipe, prompt: str, seed: int, references, **kwargs):
    """ref2va through diffusers -> (video, audio, latents, audio_latents) as `run_reference`."""
    with torchvision_substitute():
        return run_reference(pipe, prompt, seed, references=diffusers_references(references), **kwargs)
