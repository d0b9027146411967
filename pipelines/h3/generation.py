"""`GenerationRequest`: what one clip is asked to be, the same object from every face.

The CLI and the Python keywords build one `GenerationRequest` from their own input; the REST and OpenAI routes and
the web UI validate their body once (`h3gen/server/schemas.py`), the job store keeps it normalized, and the engine
makes the job's `GenerationRequest` from that (`h3gen/server/engine.py`, `generation_request`); `H3Pipeline.run`
takes it. The rules that need the checkpoint (geometry, keyframes, references, step counts against an adapter's recipe,
window lengths) are checked once by `pipelines/h3/request.py`'s `prepare_request`, which turns a `GenerationRequest`
into the `H3Request` the stages run on. This module needs no torch, so the CLI builds a request before importing it.
"""

from dataclasses import dataclass, replace

MAX_SEED = 2**63 - 1
MAX_PREVIEW_EVERY = 999  # the largest `preview_every` (the most forwards a request may have)


def _frozen(value):
    """Lists (and lists of pairs) as tuples, so that a frozen request cannot change under its holder."""
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


@dataclass(frozen=True)
class GenerationRequest:
    """One clip: a prompt and how to make it. Every field but `prompt` is optional; left None it takes the model's
    default (or the adapter's recipe's).

    prompt: the description, used verbatim.
    image, last_image: fl2va keyframes (path, PIL image or `(H, W, 3)` uint8 array) the video starts / ends on.
    references: ref2va references, in the order the model reads them: `ImageReference`, `VideoReference`,
        `AudioReference` (`pipelines/h3/references.py`; paths or in-memory media), PIL images or file paths (kind by
        suffix or content). At most 9 images, 3 videos, 3 audios, 12 in all; audio never alone.
    aspect_ratio: "W:H" in 1:4 .. 4:1; default 16:9 for t2va and ref2va, the first keyframe's ratio for fl2va.
    seconds: 5 to 15 (rounded to a 17n+5 frame count at 24 fps); `num_frames` overrides it. Default 5, or for ref2va
        the length of the first reference with sound. Longer, up to the pipeline's `max_seconds` (60 by default, at
        most 300): the clip is made in overlapping windows (`continuation.py`) and streamed to the output file.
    num_frames: the frame count itself (17n + 5).
    height, width: explicit canvas in pixels, multiples of 32 (both or neither).
    num_inference_steps: sigma grid points as in diffusers (N points = N - 1 transformer forwards), 2 to 1000;
        default 50, or the recipe's when an adapter brings one.
    forwards: transformer forwards (SGLang's and vLLM-Omni's count), 1 to 999, instead of `num_inference_steps`.
    video_shift, audio_shift: this clip's schedule shifts (default: the model's, 12 and 3 for the released
        checkpoint, or the recipe's).
    seed: the noise seed, 0 to `MAX_SEED` (2**63 - 1); a random one when None (the prepared request reports it).
    quality: `exact`, `lossless`, `high`, `fast` or `fast+high` (`h3gen.options.QUALITY_HELP`); default: the
        pipeline's.
    cache: the step cache's knobs for `high` / `fast+high`: a mapping with any of `threshold`, `warmup`,
        `max_consecutive` (`step_cache_config.py`).
    loras: adapters, stacked: `[name_or_path, (name_or_path, scale), ...]` (scale default 1.0). A few-step adapter
        brings its recipe's forwards and shifts (`recipes.py`).
    prompts: a clip over 15 s: one prompt per window (or one for all) instead of `prompt`.
    window_frames, overlap_frames: a clip over 15 s: window and overlap lengths on the 17n+5 grid (default 277 and
        22; window 124 to 345, overlap shorter than the window).
    audio_sample_rate: the MP4's AAC rate, 32000 or 48000 (default 32000).
    plan: first rewrite `prompt` with the prompt planner (K3); `plan_max_tokens` caps its answer.
    sparsity: sparse attention (VSA-H3; `sparse_attention.py`): the fraction of video tiles each video query tile
        drops, in [0, 1): one number, one per forward, or "default" (0.75 after the first fifth of the forwards).
        Default: dense for the base model, the contract's (0.9) for a FastH3 VSA student.
    dense_forwards: how many of the first forwards run dense attention when `sparsity` is given.
    preview_every: previews while denoising (`preview.py`): one every this many forwards, 0 for none, up to 999;
        default (None) about every tenth of the forwards and at least every 30 s. Made only for a callback that
        takes them (`H3Pipeline.run`).
    """

    prompt: str
    image: object = None
    last_image: object = None
    references: tuple | None = None
    aspect_ratio: str | None = None
    seconds: float | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    forwards: int | None = None
    video_shift: float | None = None
    audio_shift: float | None = None
    seed: int | None = None
    quality: str | None = None
    cache: dict | None = None
    loras: tuple | None = None
    prompts: tuple | None = None
    window_frames: int | None = None
    overlap_frames: int | None = None
    audio_sample_rate: int | None = None
    plan: bool = False
    plan_max_tokens: int | None = None
    sparsity: object = None
    dense_forwards: int | None = None
    preview_every: int | None = None

    def __post_init__(self):
        if isinstance(self.sparsity, list):
            object.__setattr__(self, "sparsity", tuple(self.sparsity))
        for name in ("references", "loras", "prompts"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if self.cache is not None and not isinstance(self.cache, dict) and hasattr(self.cache, "items"):
            object.__setattr__(self, "cache", dict(self.cache.items()))

    @property
    def task(self) -> str:
        """ref2va with references, fl2va with a keyframe, else t2va."""
        if self.references is not None:
            return "ref2va"
        return "fl2va" if self.image is not None or self.last_image is not None else "t2va"

    def replace(self, **changes) -> "GenerationRequest":
        """A copy with `changes` (field names and values)."""
        return replace(self, **changes)
