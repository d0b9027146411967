"""The MiniMax-H3 text conditioner: Qwen3-VL `hidden_states[50]` of the prompt, presented exactly as the reference.

Presentation (diffusers 0.42.1 modular_pipelines/minimax_h3/encoders.py:30-100 and 139-317): no chat template, no
special tokens, the prompt verbatim; for fl2va each keyframe first adds a `"<Picture i>: "` label and a vision block
(`<|vision_start|>`, image pads, `<|vision_end|>`), whose rows are tagged as video for the transformer's AdaLN. For
ref2va each reference adds, in order and numbered per kind, `"<Picture i>: "` + an image block, `"<Audio j>: "` alone
(sound never reaches the encoder; a video with sound says it before its video label), or `"<Video k>: "` + per pair of
frames sampled at 2 fps a `"<t seconds>"` label and a video block (encoders.py:384-658,
`MiniMaxH3Ref2VATextEncoderStep`).

Only the first 51 decoder layers are loaded and run: `hidden_states[50]` is the input of layer 51 and no later layer
can change it (the last hidden state of a 50-layer stack would be post-norm, which is why 51 and not 50). For the
64-layer Qwen3-VL-32B that skips 13 layers of weights and compute with bit-identical conditioning.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from h3gen.errors import CheckpointError, RequestError
from h3gen.pipelines.h3.references import VIDEO_SAMPLE_FPS
from h3gen.pipelines.h3.transformer_config import TEXT_TAG, VIDEO_TAG
from h3gen.pipelines.h3.video_processor import QwenVideoProcessor

TEXT_ENCODER_LAYER = 50


@dataclass
class TextConditioning:
    """`embeds` `(1, T, text_dim)` in the encoder's dtype; `token_tags` `(T,)` long (1 text, 0 vision rows)."""

    embeds: torch.Tensor
    token_tags: torch.Tensor


def load_image_processor(folder: Path):
    """The Qwen3-VL image processor from `processor/`, preferring transformers' own choice of backend and falling
    back to the PIL implementation (no torchvision needed)."""
    try:
        from transformers import AutoImageProcessor  # heavy (seconds to import): imported where it is used

        return AutoImageProcessor.from_pretrained(str(folder))
    except Exception:  # e.g. a backend that needs torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(str(folder))


class H3TextEncoder:
    """Tokenizer + Qwen3-VL (+ image processor for keyframes), producing MiniMax-H3's text conditioning."""

    def __init__(self, model, tokenizer, image_processor=None, layer: int = TEXT_ENCODER_LAYER, video_processor=None):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.layer = layer
        num_layers = len(model.model.language_model.layers)
        if num_layers <= layer:
            raise CheckpointError(
                f"MiniMax-H3 conditions on hidden_states[{layer}] of Qwen3-VL, which needs more than {layer} decoder "
                f"layers; this text encoder has {num_layers}."
            )
        self.image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video_pad_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")

    @classmethod
    def from_pretrained(
        cls, text_encoder_dir: Path, tokenizer_dir: Path, processor_dir: Path | None, *, dtype, device
    ) -> "H3TextEncoder":
        """Load the encoder truncated to `TEXT_ENCODER_LAYER + 1` decoder layers, in `dtype` on `device`."""
        # transformers is heavy (seconds to import): imported where it is used
        from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.utils import logging as hf_logging

        config = AutoConfig.from_pretrained(str(text_encoder_dir))
        text_config = getattr(config, "text_config", None)
        if text_config is None or getattr(text_config, "num_hidden_layers", 0) <= TEXT_ENCODER_LAYER:
            raise CheckpointError(
                f"{text_encoder_dir} is not a Qwen3-VL text encoder with more than {TEXT_ENCODER_LAYER} layers."
            )
        keep = TEXT_ENCODER_LAYER + 1
        if text_config.num_hidden_layers > keep:
            text_config.num_hidden_layers = keep
            if getattr(text_config, "layer_types", None):
                text_config.layer_types = text_config.layer_types[:keep]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the skipped layers' weights are reported as unused: that is the point
        try:
            model = Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), config=config, dtype=dtype)
        finally:
            hf_logging.set_verbosity(verbosity)
        model = model.to(device).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        image_processor = load_image_processor(processor_dir) if processor_dir is not None else None
        video_processor = None
        if processor_dir is not None:
            video_processor = QwenVideoProcessor.from_folder(processor_dir)
        return cls(model, tokenizer, image_processor, video_processor=video_processor)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _vision_block(self, pad_id: int, count: int) -> list[int]:
        start = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        end = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
        return [start] + [pad_id] * count + [end]

    @staticmethod
    def sample_video(
        num_frames: int, fps: float, sample_fps: float, temporal_patch: int
    ) -> tuple[list[int], list[float]]:
        """The frames the encoder reads of a 24 fps reference video (every `fps / sample_fps`-th,
        encoders.py:448-490) and the timestamp of each merged group of `temporal_patch` (the mean of its first and
        last sampled frame; the last group is padded by repeating the last timestamp)."""
        stride = fps / sample_fps
        indices, cursor = [], 0.0
        while round(cursor) < num_frames:
            if not indices or round(cursor) > indices[-1]:
                indices.append(round(cursor))
            cursor += stride
        if len(indices) < temporal_patch:
            raise RequestError(
                f"a reference video needs at least {round((temporal_patch - 1) * stride) + 1} frames "
                f"at {fps:g} fps (got {num_frames}).",
                "references",
            )
        times = [index / sample_fps for index in range(len(indices))]
        times += [times[-1]] * (-len(times) % temporal_patch)
        return indices, [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]

    def _present_references(self, prompt: str, references: list) -> tuple[list[int], list[int], dict]:
        """Token ids, tags and vision inputs of a ref2va presentation. Vision tensors are batched per kind (Qwen3-VL
        fills the n-th pad run of a kind with the n-th item of that kind's batch), labels follow request order."""
        if self.image_processor is None or self.video_processor is None:
            raise CheckpointError("This checkpoint has no processor/ folder, which reference prompts need.")
        merge = self.image_processor.merge_size**2
        vision_inputs, image_tokens, video_tokens, video_times = {}, [], [], []
        images = [reference.image for reference in references if reference.kind == "image"]
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            vision_inputs.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
            image_tokens = [int(grid.prod()) // merge for grid in vision["image_grid_thw"]]
        videos = [reference for reference in references if reference.kind == "video"]
        if videos:
            sampled = []
            for reference in videos:
                indices, times = self.sample_video(
                    reference.frames.shape[0], 24.0, VIDEO_SAMPLE_FPS, self.video_processor.temporal_patch_size
                )
                sampled.append(reference.frames[indices])
                video_times.append(times)
            vision = self.video_processor(sampled)
            vision_inputs.update(vision)
            for grid, times in zip(vision["video_grid_thw"], video_times, strict=True):
                if int(grid[0]) != len(times):
                    raise RuntimeError(
                        f"the video processor merged {int(grid[0])} frame groups for {len(times)} "
                        "timestamps; its temporal patch disagrees with the sampling."
                    )
                video_tokens.append(int(grid[1]) * int(grid[2]) // merge)

        token_ids, tags = [], []

        def text(value: str) -> None:
            ids = self.tokenize(value)
            token_ids.extend(ids)
            tags.extend([TEXT_TAG] * len(ids))

        def block(pad_id: int, count: int) -> None:
            ids = self._vision_block(pad_id, count)
            token_ids.extend(ids)
            tags.extend([VIDEO_TAG] * len(ids))

        counts = {"image": 0, "video": 0, "audio": 0}
        for reference in references:
            if reference.has_audio:
                counts["audio"] += 1
                text(f"<Audio {counts['audio']}>: ")
            if reference.kind == "image":
                counts["image"] += 1
                text(f"<Picture {counts['image']}>: ")
                block(self.image_pad_id, image_tokens[counts["image"] - 1])
            elif reference.kind == "video":
                counts["video"] += 1
                text(f"<Video {counts['video']}>: ")
                for timestamp in video_times[counts["video"] - 1]:
                    text(f"<{timestamp:.1f} seconds>")  # format() rounds half to even: 0.25 -> "0.2"
                    block(self.video_pad_id, video_tokens[counts["video"] - 1])
        text(prompt)
        return token_ids, tags, vision_inputs

    @torch.no_grad()
    def encode(self, prompt: str, keyframes: list = (), references: list | None = None) -> TextConditioning:
        """Encode `prompt`, preceded by one labelled vision block per keyframe (PIL RGB images already on the
        canvas), or by the labels and vision blocks of ref2va `references` (normalized `PreparedReference`s, in
        order). Returns `hidden_states[50]` in the encoder's dtype and the per-row tags."""
        token_ids: list[int] = []
        tags: list[int] = []
        vision_inputs = {}
        if references:
            token_ids, tags, vision_inputs = self._present_references(prompt, references)
        elif keyframes:
            if self.image_processor is None:
                raise CheckpointError("This checkpoint has no processor/ folder, which keyframe prompts need.")
            vision = self.image_processor(images=list(keyframes), return_tensors="pt")
            grid = vision["image_grid_thw"]
            vision_inputs = {"pixel_values": vision["pixel_values"], "image_grid_thw": grid}
            merge = self.image_processor.merge_size**2
            start = self.tokenizer.convert_tokens_to_ids("<|vision_start|>")
            end = self.tokenizer.convert_tokens_to_ids("<|vision_end|>")
            for index in range(len(keyframes)):
                label = self.tokenize(f"<Picture {index + 1}>: ")
                block = [start] + [self.image_pad_id] * (int(grid[index].prod()) // merge) + [end]
                token_ids += label + block
                tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        if not references:
            prompt_ids = self.tokenize(prompt)
            token_ids += prompt_ids
            tags += [TEXT_TAG] * len(prompt_ids)

        device = self.device
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        # Qwen-internal modality ids (0 text, 1 image, 2 video) drive Qwen3-VL's multimodal rotary layout.
        mm_types = torch.zeros_like(input_ids)
        mm_types[input_ids == self.image_pad_id] = 1
        mm_types[input_ids == self.video_pad_id] = 2
        kwargs = {
            name: value.to(device, self.dtype) if name.startswith("pixel_") else value.to(device)
            for name, value in vision_inputs.items()
        }
        outputs = self.model.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_types,
            use_cache=False,
            output_hidden_states=True,
            **kwargs,
        )
        embeds = outputs.hidden_states[self.layer].to(dtype=self.dtype)
        return TextConditioning(embeds=embeds, token_tags=torch.tensor(tags, dtype=torch.long))
