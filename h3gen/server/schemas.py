"""The request and response shapes of the REST API (validated once, with pydantic)."""

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from h3gen.options import QUALITY_HELP, QUALITY_TIERS, TASKS, describe
from h3gen.pipelines.h3 import (
    CACHE_HELP,
    DEFAULT_MAX_SECONDS,
    MAX_CONSECUTIVE_RANGE,
    MAX_PREVIEW_EVERY,
    MAX_SECONDS,
    MAX_SECONDS_LIMIT,
    MAX_SEED,
    MAX_SHIFT,
    MIN_SECONDS,
    MIN_SHIFT,
    THRESHOLD_RANGE,
    WARMUP_RANGE,
)
from h3gen.server.json_text import JsonRefused, parse_json

MAX_PROMPT_CHARS = 4000
MAX_WINDOW_PROMPTS = 64  # a 300 s clip in the shortest windows (124 frames, overlap 5) has 61
IMAGE_FIELDS = ("image", "last_image")
# ref2va uploads, each repeatable; the order of the parts is the order of the references.
REFERENCE_FIELDS = ("ref_image", "ref_video", "ref_audio")
# The kind of content each upload field takes (what its bytes must decode as).
UPLOAD_KINDS = {
    "image": "image",
    "last_image": "image",
    "input_reference": "image",
    "ref_image": "image",
    "ref_video": "video",
    "ref_audio": "audio",
}
MAX_LORAS = 8  # adapters one request may stack
ASPECT_RATIO = r"^[0-9]{1,4}(\.[0-9]{1,3})?:[0-9]{1,4}(\.[0-9]{1,3})?$"


def _json_field(text: str, field: str, expected: str):
    """The value of JSON text a form or string field carries, parsed within the body's limits (`json_text`)."""
    try:
        return parse_json(text, field)
    except JsonRefused as error:
        raise PydanticCustomError(
            "value_error",
            "{field} must be {expected} ({problem})",
            {"field": field, "expected": expected, "problem": str(error)},
        ) from None


class CacheKnobs(BaseModel):
    """The step cache's knobs (quality high / fast+high); each one left out takes its default."""

    model_config = ConfigDict(extra="forbid")

    threshold: float | None = Field(
        None, ge=THRESHOLD_RANGE[0], le=THRESHOLD_RANGE[1], description=CACHE_HELP["threshold"]
    )
    warmup: int | None = Field(None, ge=WARMUP_RANGE[0], le=WARMUP_RANGE[1], description=CACHE_HELP["warmup"])
    max_consecutive: int | None = Field(
        None, ge=MAX_CONSECUTIVE_RANGE[0], le=MAX_CONSECUTIVE_RANGE[1], description=CACHE_HELP["max_consecutive"]
    )


class GenerationBody(BaseModel):
    """One generation job as the REST API takes it (JSON or a multipart form; the files come as uploads), published
    as `GenerationRequest`; the engine turns it into the pipeline's `GenerationRequest`. Unknown fields are rejected
    (no negative prompt, no guidance: the model is distilled)."""

    model_config = ConfigDict(extra="forbid", title="GenerationRequest")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="What to generate, used verbatim.")
    task: Literal[TASKS] = Field(
        "t2va",
        description="t2va: text only; fl2va: first and/or last keyframe (multipart `image`, `last_image`); "
        "ref2va: references (multipart `ref_image`, `ref_video`, `ref_audio`, repeatable, in order).",
    )
    aspect_ratio: str | None = Field(
        None,
        json_schema_extra={"pattern": ASPECT_RATIO},
        description="W:H from 1:4 to 4:1; default 16:9 (t2va) or the first keyframe's (fl2va).",
    )
    # The range is checked with the request against the limit in force (engine.validate), so that every face
    # words it the same way; the schema shows the most any server takes.
    seconds: float | None = Field(
        None,
        allow_inf_nan=False,
        json_schema_extra={"minimum": MIN_SECONDS, "maximum": MAX_SECONDS_LIMIT},
        description=(
            f"Length at 24 fps, as a number or a numeric string (OpenAI's `\"8\"`): 5 to the server's limit "
            f"({DEFAULT_MAX_SECONDS:g} s unless started with --max-seconds, at most {MAX_SECONDS_LIMIT:g}); over "
            f"{MAX_SECONDS:g} s the clip is made in overlapping windows. Default 5, or for ref2va the length of the "
            "first reference with sound."
        ),
    )
    prompts: list[str] | None = Field(
        None,
        max_length=MAX_WINDOW_PROMPTS,
        description=(
            "A clip over 15 s: one prompt per window (or one for all) instead of `prompt`; a list of another length is "
            "refused with the request's window count. In a multipart form: one field holding a JSON list."
        ),
    )
    window_frames: int | None = Field(
        None, description=("A clip over 15 s: frames per window, on the 17n+5 grid from 124 to 345 (default 277).")
    )
    overlap_frames: int | None = Field(
        None,
        description=(
            "A clip over 15 s: frames each window repeats of the previous one (its guide), on the 17n+5 grid and "
            "shorter than the window (default 22)."
        ),
    )
    size: str | None = Field(
        None,
        max_length=16,
        description=(
            "OpenAI's `WxH` (e.g. 1280x720): sets the aspect ratio; the canvas is made on MiniMax-H3's grid at its own "
            "resolution (the job's `width` x `height`). Give size or aspect_ratio, not both."
        ),
    )
    model: str | None = Field(None, max_length=128, description="The served model's id (GET /v1/models); optional.")
    input_reference: "InputReference | None" = Field(
        None,
        description=(
            "OpenAI's input reference: the first keyframe (task fl2va). As JSON "
            "`{image_url: data:image/...;base64,...}` or as a multipart file part named input_reference; URLs are "
            "never fetched."
        ),
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Noise seed; random when omitted.")
    num_inference_steps: int | None = Field(
        None,
        ge=2,
        le=1000,
        description=(
            "Sigma grid points, as diffusers counts them: N points run N - 1 transformer forwards. Default 50 (49 "
            "forwards), or the few-step recipe's when an adapter brings one. Give this or `forwards`, not both."
        ),
    )
    forwards: int | None = Field(
        None,
        ge=1,
        le=999,
        description=(
            "Transformer forwards, as SGLang and vLLM-Omni count steps (forwards = num_inference_steps - 1). Give this "
            "or `num_inference_steps`, not both."
        ),
    )
    video_shift: float | None = Field(
        None,
        ge=MIN_SHIFT,
        le=MAX_SHIFT,
        description=(
            "The video schedule's shift for this job (default: the model's, 12 for the released checkpoint, or the "
            "recipe's)."
        ),
    )
    audio_shift: float | None = Field(
        None,
        ge=MIN_SHIFT,
        le=MAX_SHIFT,
        description=("The audio schedule's shift for this job (default: the model's, 3, or the recipe's)."),
    )
    audio_sample_rate: Literal[32000, 48000] = Field(32000, description="AAC sample rate of the MP4.")
    quality: Literal[QUALITY_TIERS] | None = Field(
        None,
        description=f"{describe(QUALITY_HELP)}. The server's tier if omitted; fast and fast+high only on a "
        "server started with --quality fast or fast+high, which serves only those two.",
    )
    cache: CacheKnobs | None = Field(
        None,
        description=(
            "quality high / fast+high only: the step cache's knobs, an object (a JSON text in a multipart form) with "
            "any of threshold, warmup, max_consecutive; the job's cached_steps lists the forwards it skipped."
        ),
    )
    loras: "list[LoraRequest] | None" = Field(
        None,
        max_length=MAX_LORAS,
        description=(
            f"Adapters from the server's --lora-dir (GET /v1/loras lists them), stacked, at most {MAX_LORAS}: "
            '`[{"name": "style", "scale": 0.7}]` (scale default 1.0); in a multipart body the same list as a '
            "JSON string. A few-step adapter (LightX2V Turbo, FlashGen) brings its recipe's forwards and shifts."
        ),
    )
    sparsity: float | list[float] | Literal["default"] | None = Field(
        None,
        description=(
            "Sparse attention (VSA-H3): the fraction of video tiles each video query tile drops, from 0 up to (not "
            'including) 1: one number, one per transformer forward, or "default" (0.75 after the first fifth of the '
            "forwards ran dense); text, condition and audio rows stay dense. Default: dense on the base model, the "
            "contract's (0.9) on a FastH3 VSA student. In a multipart body a number, a JSON list or default."
        ),
    )
    dense_forwards: int | None = Field(
        None, ge=0, le=999, description="With `sparsity`: how many of the first forwards run dense attention."
    )
    preview_every: int | None = Field(
        None,
        ge=0,
        le=MAX_PREVIEW_EVERY,
        description=(
            "Previews while the job denoises: a JPEG every this many forwards (0: none), at "
            "GET /v1/videos/{id}/content?variant=preview; the job's preview_at says when the latest was made. Default: "
            "about every tenth of the forwards and at least every 30 s."
        ),
    )
    plan: bool = Field(
        False,
        description=(
            "First rewrite the prompt with the server's K3 planner (subjects, motion, camera, sound, music, dialogue); "
            "the job's `planned_prompt` shows what the clip was made from. Needs a server started with --planner."
        ),
    )

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_from_text(cls, value):
        # A multipart form carries the list as one JSON text field.
        if isinstance(value, str):
            return _json_field(value, "loras", 'a JSON list such as [{"name": "style", "scale": 0.7}]')
        return value

    @field_validator("sparsity", mode="before")
    @classmethod
    def _sparsity_value(cls, value):
        # One check for every form of the field (a JSON number, list or "default"; a multipart form's text of any of
        # them), so a bad value is one error on `sparsity`, not one per member of the type's union.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = _json_field(text, "sparsity", 'a number, a JSON list of numbers or "default"')
            elif text == "default":
                return "default"
            else:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(
            isinstance(one, (int, float)) and not isinstance(one, bool) and 0 <= one < 1 for one in values
        ):
            raise PydanticCustomError(
                "value_error",
                "sparsity must be a number from 0 up to (not including) 1, a list of them (one per forward) or "
                '"default" (got {value})',
                {"value": str(value)[:40]},
            )
        return value

    @field_validator("aspect_ratio")
    @classmethod
    def _aspect_ratio_shape(cls, value: str | None) -> str | None:
        # The CLI's wording, not the pattern's (the range, 1:4 to 4:1, is checked with the geometry).
        if value is not None and not re.fullmatch(ASPECT_RATIO, value):
            raise PydanticCustomError(
                "value_error",
                "aspect_ratio must look like 16:9 (W:H from 1:4 to 4:1; got {value})",
                {"value": value[:32]},
            )
        return value

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_from_text(cls, value):
        # A multipart form carries the object as JSON text.
        if isinstance(value, str):
            return _json_field(value, "cache", 'a JSON object such as {"threshold": 0.04}')
        return value

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompts_from_a_form(cls, value):
        # A multipart form sends the list once, as JSON text (a form may not repeat a field).
        if isinstance(value, str) and value.lstrip().startswith("["):
            return _json_field(value, "prompts", "a JSON list of strings in a form field")
        return value

    @field_validator("prompts")
    @classmethod
    def _prompts_text(cls, value: list[str] | None) -> list[str] | None:
        for text in value or ():
            if not text.strip() or len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompts must be non-empty strings of at most {MAX_PROMPT_CHARS} characters")
        return value


class LoraRequest(BaseModel):
    """One adapter of a request: its name in the server's LoRA folder and its scale."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=200,
        description="The adapter's file name in --lora-dir, with or without .safetensors (GET /v1/loras lists them).",
    )
    scale: float = Field(1.0, ge=-10.0, le=10.0, allow_inf_nan=False, description="Its scale (default 1.0).")


class LoraInfo(BaseModel):
    """One adapter of `GET /v1/loras`."""

    name: str
    size: int = Field(description="File size in bytes.")
    format: str | None = None
    rank: int | list[int] | None = None
    alpha: float | None = Field(
        None,
        description="The uniform network alpha, or None where alpha = rank or the modules' own .alpha tensors apply.",
    )
    alpha_source: str | None = None
    partition: list[str] | None = Field(
        None, description="transformer (t2va, fl2va) and / or transformer_ref (ref2va)."
    )
    recipe: dict | None = Field(
        None,
        description="The few-step recipe it brings (forwards, num_inference_steps, "
        "shifts, tasks, base_schedule), or None.",
    )
    error: str | None = Field(None, description="Why the file cannot be used, when it cannot.")


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraInfo]


class InputReference(BaseModel):
    """OpenAI's `ImageInputReferenceParam`: an image as a base64 data URL, or a file id."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(None, description="data:image/...;base64,... (never fetched from the network)")
    file_id: str | None = Field(None, max_length=128, description="not served: this server keeps no files")


GenerationBody.model_rebuild()


class RemixRequest(BaseModel):
    """`POST /v1/videos/{id}/remix`: a new job with the source's settings and this prompt."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="The new prompt.")


class PlanRequest(BaseModel):
    """`POST /v1/prompts/plan`: a short idea -> an H3 prompt."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="The idea to plan.")
    max_tokens: int = Field(512, ge=1, le=4096, description="Most tokens the planner may write.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Sampling seed; random when omitted.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Sampling temperature (planner default).")
    stream: bool = Field(
        False,
        description="Answer as server-sent events: `delta` events with the text as it is "
        "written, then one `done` event holding the PlanResponse (or `error`).",
    )


class PlanResponse(BaseModel):
    prompt: str
    planned_prompt: str
    backend: str
    tokens: int | None = None
    seconds: float


class VideoError(BaseModel):
    code: str = Field(description='"cancelled", or "generation_failed" with the reason in `message`.')
    message: str


class VideoObject(BaseModel):
    """OpenAI's `Video` object (as the `openai` SDK defines it), with H3's job fields as extensions."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"] = Field(
        description='A cancelled job reads as failed with error.code "cancelled".'
    )
    progress: int = Field(description="0-100, by stage and denoising step.")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = Field(None, description="When retention removes the video (Unix seconds).")
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    seconds: str = Field(description="The length asked for; `duration` is the one made (17n + 5 frames at 24 fps).")
    size: str = Field(description="The size asked for (WxH); `width` x `height` is the canvas made.")
    error: VideoError | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    job_status: str | None = Field(
        None,
        description="Deprecated: the status as named before (running, succeeded, "
        "cancelled, ...); goes in the next release.",
    )
    stage: str | None = Field(None, description="The stage running now.")
    window: str | None = Field(None, description='A clip over 15 s: the window being made, as "2/5".')
    eta_seconds: float | None = Field(
        None, description="While it runs: the seconds left, from its measured forwards (null until one is measured)."
    )
    preview_at: float | None = Field(
        None,
        description="While it runs: when its latest preview was made (Unix seconds; null before the first); the JPEG "
        "is GET /v1/videos/{id}/content?variant=preview.",
    )
    preview: dict | None = Field(
        None,
        description='The latest preview: forward and forwards it was made after, window ("2/5" or null), seconds it '
        "took, url.",
    )
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per stage.")
    request: dict = Field(default_factory=dict, description="The normalized request (resolved size, frames, seed).")
    planned_prompt: str | None = Field(None, description="The planner's prompt, once a job with plan=true has it.")
    cached_steps: list[int] | None = Field(
        None,
        description=(
            "quality high / fast+high, once the job has run: the denoising forwards (0-based) the step cache skipped; "
            "every other forward ran all blocks."
        ),
    )
    queue_position: int | None = None
    content_url: str | None = None
    started_at: float | None = None
    finished_at: float | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class VideoDeleted(BaseModel):
    """OpenAI's `VideoDeleteResponse`; `video` is the video's state after the call."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool
    video: VideoObject


class Health(BaseModel):
    """Readiness for anyone; the rest only for a caller with the API key (or on a server without one)."""

    status: Literal["ok"]
    ready: bool
    model: str | None = None
    devices: list[str] | None = None
    queue_depth: int | None = None
    running: str | None = None
    load_error: str | None = None
    workers: list[dict] | None = None  # the live workers: id, host, what each serves, the job it runs
    queue_by_task: dict[str, int] | None = None  # queued jobs per task


def request_body_schema() -> dict:
    """The OpenAPI request body of `POST /v1/videos`: JSON, or multipart with its files."""
    json_schema = GenerationBody.model_json_schema()
    multipart = json.loads(json.dumps(json_schema))
    multipart["additionalProperties"] = False
    for name in IMAGE_FIELDS:
        multipart["properties"][name] = {"type": "string", "format": "binary", "description": f"fl2va {name} file"}
    multipart["properties"]["loras"] = {"type": "string", "description": "the `loras` list as a JSON string"}
    multipart["properties"]["input_reference"] = {
        "type": "string",
        "format": "binary",
        "description": "OpenAI's input reference: the fl2va first frame",
    }
    for name in REFERENCE_FIELDS:
        multipart["properties"][name] = {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "description": f"ref2va {name.split('_')[1]} reference files (repeat the part; parts keep their order)",
        }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_schema}, "multipart/form-data": {"schema": multipart}},
        }
    }
