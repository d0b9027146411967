"""MiniMax-H3: the public surface of the pipeline, what the server, the CLI, the UI and the benchmarks build on.

- The request: `GenerationRequest` (what a clip is asked to be, from any face), `prepare_request` / `H3Request` (it
  checked against a checkpoint, media decoded once), `read_transformer_config`, `H3Checkpoint`, the reference types.
- The pipeline: `H3Pipeline` (`from_pretrained`, `prepare`, `run`), `H3Output`, `random_pipeline` (the tiny demo
  model is `tiny_checkpoint.tiny_checkpoint`).
- Its stages, for callers that compose their own flow: `Components`, `encode_text`, `draw_noise`,
  `encode_conditions`, `pack`, `denoise`, `decode_frames`, `decode_sound`, `ClipWriter`; `STAGES`, their names;
  `Preview` (what a callback gets while denoising, as `PREVIEW`), `MAX_PREVIEW_EVERY`.
- The limits and checks every face words the same way: lengths (`DEFAULT_MAX_SECONDS`, `MAX_SECONDS_LIMIT`,
  `MIN_SECONDS`, `MAX_SECONDS`, `check_seconds`, `check_max_seconds`, windows), aspect ratios, seeds, shifts, the
  step cache's knobs, reference counts.
- Adapters: `read_lora` / `LoraFile`, `recipe_for`, the device budget of adapters (`lora_device_bytes`, ...).

Names load lazily, so the light modules (the request spec, geometry, continuation, step-cache knobs) import without
torch.
"""

_PUBLIC = {
    "GenerationRequest": "generation",
    "MAX_SEED": "generation",
    "H3Request": "request",
    "prepare_request": "request",
    "checkpoint_student": "request",
    "load_time_contract": "load_contract",
    "StudentContract": "fasth3",
    "resolve_sparsity": "sparse_attention",
    "with_prompt": "request",
    "read_transformer_config": "request",
    "H3Checkpoint": "checkpoint",
    "resolve_workflow": "checkpoint",
    "ImageReference": "references",
    "VideoReference": "references",
    "AudioReference": "references",
    "H3Pipeline": "pipeline",
    "H3Output": "output",
    "random_pipeline": "random_weights",
    "Components": "stages",
    "encode_text": "stages",
    "draw_noise": "stages",
    "encode_conditions": "stages",
    "pack": "stages",
    "denoise": "stages",
    "decode_frames": "decode_stages",
    "decode_sound": "decode_stages",
    "ClipWriter": "decode_stages",
    "STAGES": "progress",
    "PREVIEW": "progress",
    "Preview": "preview",
    "MAX_PREVIEW_EVERY": "generation",
    "DEFAULT_MAX_SECONDS": "continuation",
    "MAX_SECONDS_LIMIT": "continuation",
    "check_max_seconds": "continuation",
    "MIN_SECONDS": "geometry",
    "MAX_SECONDS": "geometry",
    "FPS": "geometry",
    "SPATIAL_COMPRESSION": "geometry",
    "resolve_canvas": "geometry",
    "MIN_SHIFT": "recipes",
    "MAX_SHIFT": "recipes",
    "StepCacheConfig": "step_cache_config",
    "MIN_ASPECT": "geometry",
    "MAX_ASPECT": "geometry",
    "parse_aspect_ratio": "geometry",
    "DEFAULT_WINDOW_FRAMES": "continuation",
    "DEFAULT_OVERLAP_FRAMES": "continuation",
    "check_seconds": "continuation",
    "check_windows": "continuation",
    "MAX_REFERENCES": "references",
    "CACHE_HELP": "step_cache_config",
    "THRESHOLD_RANGE": "step_cache_config",
    "WARMUP_RANGE": "step_cache_config",
    "MAX_CONSECUTIVE_RANGE": "step_cache_config",
    "LoraFile": "lora_formats",
    "read_lora": "lora_formats",
    "recipe_for": "recipes",
    "lora_budget_bytes": "lora_registry",
    "lora_device_bytes": "lora_registry",
    "check_device_budget": "lora_registry",
    "H3Transformer": "transformer",
    "H3TransformerConfig": "transformer_config",
    "H3TransformerOutput": "transformer",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'h3gen.pipelines.h3' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"h3gen.pipelines.h3.{module}"), name)
