"""The MiniMax-H3 text conditioner: Qwen3-VL `hidden_states[50]` of the prompt, presented exactly as the reference.

Presentation (h3-model.md §7, ENC:139-300): no chat template, no special tokens, the prompt verbatim; for fl2va each
keyframe first adds a `"<Picture i>: "` label and a vision block (`<|vision_start|>`, image pads, `<|vision_end|>`),
whose rows are tagged as video for the transformer's AdaLN.

Only the first 51 decoder layers are loaded and run: `hidden_states[50]` is the input of layer 51 and no later layer
can change it (the last hidden state of a 50-layer stack would be post-norm, which is why 51 and not 50). For the
64-layer Qwen3-VL-32B that skips 13 layers of weights and compute with bit-identical conditioning.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from h3gen.errors import CheckpointError
from h3gen.pipelines.h3.transformer import TEXT_TAG, VIDEO_TAG

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
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(folder))
    except Exception:  # e.g. a backend that needs torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(str(folder))


class H3TextEncoder:
    """Tokenizer + Qwen3-VL (+ image processor for keyframes), producing MiniMax-H3's text conditioning."""

    def __init__(self, model, tokenizer, image_processor=None, layer: int = TEXT_ENCODER_LAYER):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
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
        return cls(model, tokenizer, image_processor)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def encode(self, prompt: str, keyframes: list = ()) -> TextConditioning:
        """Encode `prompt`, preceded by one labelled vision block per keyframe (PIL RGB images already on the
        canvas). Returns `hidden_states[50]` in the encoder's dtype and the per-row tags."""
        token_ids: list[int] = []
        tags: list[int] = []
        vision_inputs = {}
        if keyframes:
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
