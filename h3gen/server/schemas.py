"""The request and response shapes of the REST API (validated once, with pydantic)."""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from h3gen.options import QUALITY_HELP, QUALITY_TIERS, TASKS, describe

MAX_PROMPT_CHARS = 4000
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
IMAGE_FIELDS = ("image", "last_image")
# ref2va uploads, each repeatable; the order of the parts is the order of the references.
REFERENCE_FIELDS = ("ref_image", "ref_video", "ref_audio")
# The kind of content each upload field takes (what its bytes must decode as).
UPLOAD_KINDS = {"image": "image", "last_image": "image", "ref_image": "image", "ref_video": "video",
                "ref_audio": "audio"}
ASPECT_RATIO = r"^[0-9]{1,4}(\.[0-9]{1,3})?:[0-9]{1,4}(\.[0-9]{1,3})?$"


class GenerationRequest(BaseModel):
    """One generation job. Unknown fields are rejected (no negative prompt, no guidance: the model is distilled)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="What to generate, used verbatim.")
    task: Literal[TASKS] = Field(
        "t2va", description="t2va: text only; fl2va: first and/or last keyframe (multipart `image`, `last_image`); "
                            "ref2va: references (multipart `ref_image`, `ref_video`, `ref_audio`, repeatable, in order)."
    )
    aspect_ratio: str | None = Field(
        None, json_schema_extra={"pattern": ASPECT_RATIO},
        description="W:H from 1:4 to 4:1; default 16:9 (t2va) or the first keyframe's (fl2va).",
    )
    seconds: float | None = Field(None, ge=5.0, le=15.0, description=(
        "Length, 5 to 15 s at 24 fps. Default 5, or for ref2va the length of the first reference with sound."))
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Noise seed; random when omitted.")
    num_inference_steps: int = Field(50, ge=2, le=1000, description="Sigma grid points (N - 1 transformer forwards).")
    audio_sample_rate: Literal[32000, 48000] = Field(32000, description="AAC sample rate of the MP4.")
    quality: Literal[QUALITY_TIERS] | None = Field(
        None, description=f"{describe(QUALITY_HELP)}. The server's tier if omitted; fast only on a server started "
                          "with --quality fast, which serves only fast.")
    plan: bool = Field(False, description=(
        "First rewrite the prompt with the server's K3 planner (subjects, motion, camera, sound, music, dialogue); "
        "the job's `planned_prompt` shows what the clip was made from. Needs a server started with --planner."))

    @field_validator("aspect_ratio")
    @classmethod
    def _aspect_ratio_shape(cls, value: str | None) -> str | None:
        # The CLI's wording, not the pattern's (the range, 1:4 to 4:1, is checked with the geometry).
        if value is not None and not re.fullmatch(ASPECT_RATIO, value):
            raise PydanticCustomError("value_error", "aspect_ratio must look like 16:9 (W:H from 1:4 to 4:1; got "
                                      "{value})", {"value": value[:32]})
        return value


class PlanRequest(BaseModel):
    """`POST /v1/prompts/plan`: a short idea -> an H3 prompt."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="The idea to plan.")
    max_tokens: int = Field(512, ge=1, le=4096, description="Most tokens the planner may write.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Sampling seed; random when omitted.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Sampling temperature (planner default).")
    stream: bool = Field(False, description="Answer as server-sent events: `delta` events with the text as it is "
                                            "written, then one `done` event holding the PlanResponse (or `error`).")


class PlanResponse(BaseModel):
    prompt: str
    planned_prompt: str
    backend: str
    tokens: int | None = None
    seconds: float


class JobCreated(BaseModel):
    id: str
    status: str
    created_at: float


class JobView(BaseModel):
    """Everything a client may want to know about a job."""

    id: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    progress: float = Field(description="0-100, by stage and denoising step.")
    stage: str | None = None
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per finished stage.")
    error: str | None = None
    request: dict = Field(default_factory=dict, description="The normalized request (resolved size, frames, seed).")
    planned_prompt: str | None = Field(None, description="The planner's prompt, once a job with plan=true has it.")
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_position: int | None = None
    content_url: str | None = None


class JobList(BaseModel):
    data: list[JobView]
    has_more: bool
    last_id: str | None = None


class Health(BaseModel):
    """Readiness for anyone; the rest only for a caller with the API key (or on a server without one)."""

    status: Literal["ok"]
    ready: bool
    model: str | None = None
    devices: list[str] | None = None
    queue_depth: int | None = None
    running: str | None = None
    load_error: str | None = None
