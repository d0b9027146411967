"""OpenAI's video API on top of h3gen's jobs: the `Video` object a job is shown as, and how OpenAI's request fields
(`model`, `size`, `seconds`, `input_reference`) map onto MiniMax-H3's.

The shapes follow the official `openai` Python SDK (`openai.types.Video`, `VideoDeleteResponse`, the cursor page of
`videos.list`): clients written for it work unchanged. H3's own fields ride along as extensions of the same object
(the SDK keeps unknown fields), so nothing an h3gen client reads is lost.
"""

import base64
import binascii
import re

from h3gen.errors import RequestError
from h3gen.pipelines.h3 import MAX_ASPECT, MIN_ASPECT
from h3gen.server.job import JobStatus

DEFAULT_MODEL_ID = "MiniMax-H3"

# A job's status in the store -> the SDK's four. A cancelled job is a failed video whose error code says so.
OPENAI_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "in_progress",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "failed",
}
VARIANTS = ("video", "thumbnail", "spritesheet", "preview")
SIZE_PATTERN = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
# The H3 job fields a `Video` carries besides OpenAI's own (what GET /v1/videos/{id} showed before, minus status).
EXTENSION_FIELDS = (
    "stage",
    "window",
    "eta_seconds",
    "preview_at",
    "preview",
    "timings",
    "request",
    "planned_prompt",
    "cached_steps",
    "queue_position",
    "content_url",
    "started_at",
    "finished_at",
)

# How often a polling client should ask again: one denoising step's measured time, within these bounds.
POLL_AFTER_MS_MIN, POLL_AFTER_MS_MAX = 250, 5000


def parse_size(size: str) -> tuple[int, int]:
    """`"1280x720"` -> (width 1280, height 720). Raises `RequestError` naming `size`."""
    match = SIZE_PATTERN.match(str(size).strip())
    if not match or not int(match[1]) or not int(match[2]):
        raise RequestError(f"size must look like 1280x720 (width x height in pixels; got {str(size)[:40]!r}).", "size")
    return int(match[1]), int(match[2])


def image_from_data_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL. The server never fetches a URL: anything else is refused."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError(
            "input_reference.image_url must be a data: URL (data:image/png;base64,...); this server "
            "never fetches URLs. Upload the image as the input_reference file instead.",
            "input_reference",
        )
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise RequestError(
            "input_reference.image_url must be a base64 image data URL (data:image/png;base64,...).", "input_reference"
        )
    try:
        # A megabyte at a time: one call over a 27 MB payload would hold the GIL for about 0.1 s.
        step = 1 << 20  # a multiple of 4, so each slice decodes on its own
        return b"".join(
            base64.b64decode(payload[start : start + step], validate=True) for start in range(0, len(payload), step)
        )
    except (binascii.Error, ValueError):
        raise RequestError("input_reference.image_url is not valid base64.", "input_reference") from None


def _seconds_string(request: dict) -> str:
    """The length the job asked for, as OpenAI's string ("5", "40"); `duration` says what was made."""
    seconds = request.get("seconds")
    return "" if seconds is None else f"{float(seconds):g}"


def _error(view: dict) -> dict | None:
    if view["status"] == "cancelled":
        return {"code": "cancelled", "message": "the job was cancelled"}
    if view["status"] == "failed":
        return {"code": "generation_failed", "message": view.get("error") or "the job failed"}
    return None


def video_object(view: dict, *, model: str, retention_seconds: float | None = None) -> dict:
    """A job's public view (`JobManager.view`) as OpenAI's `Video` object, with H3's fields as extensions.

    `size` is the size the client asked for (`WxH`), or the canvas made when it asked for none; `width` and
    `height` are the canvas MiniMax-H3 made (its 32-pixel grid at its own resolution). `seconds` likewise: the
    length asked for, `duration` the one made (frames / 24 on the 17n + 5 grid)."""
    request = view.get("request") or {}
    finished = view.get("finished_at")
    status = OPENAI_STATUS[view["status"]]
    width, height = request.get("width"), request.get("height")
    size = request.get("size") or (f"{width}x{height}" if width and height else "")
    video = {
        "id": view["id"],
        "object": "video",
        "model": model,
        "status": status,
        "progress": 100 if status == "completed" else int(view.get("progress") or 0),
        "created_at": int(view["created_at"]),
        "completed_at": int(finished) if finished and status in ("completed", "failed") else None,
        "expires_at": int(finished + retention_seconds) if finished and retention_seconds else None,
        "prompt": request.get("prompt"),
        "remixed_from_video_id": request.get("remixed_from_video_id"),
        "seconds": _seconds_string(request),
        "size": size,
        "error": _error(view),
        "width": width,
        "height": height,
        "duration": request.get("duration"),
        "job_status": view["status"],  # deprecated: the status names before OpenAI's (running, succeeded, ...)
    }
    video.update({name: view.get(name) for name in EXTENSION_FIELDS})
    return video


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (`{"error": ...}` in a 4xx / 5xx body)."""
    return {"message": message, "type": kind, "param": param, "code": None}


def poll_after_ms(step_seconds: float | None) -> int:
    """The `openai-poll-after-ms` to send: one measured denoising step (bounded), or a second with no measurement."""
    if not step_seconds:
        return 1000
    return int(min(max(step_seconds * 1000, POLL_AFTER_MS_MIN), POLL_AFTER_MS_MAX))


def model_list(model: str, tasks: tuple[str, ...], created: int) -> dict:
    """`GET /v1/models`: the one model this server serves, with the tasks it answers."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "h3gen", "tasks": list(tasks)}],
    }


def nearest_size_error(width: int, height: int, canvas) -> RequestError:
    """The 4xx for a `size` whose aspect ratio MiniMax-H3 cannot make, naming the nearest size it can:
    `canvas(aspect_width, aspect_height) -> (height, width)` is the model's canvas for an allowed aspect ratio."""
    ratio = min(max(width / height, MIN_ASPECT), MAX_ASPECT)
    near_height, near_width = canvas(ratio, 1.0)
    return RequestError(
        f"size {width}x{height} is outside MiniMax-H3's aspect ratios (1:4 to 4:1); the nearest size "
        f"it can make is {near_width}x{near_height}.",
        "size",
    )


def openai_fields(request, uploads: dict, *, model_id: str, canvas, save_image) -> object:
    """`request` (a `GenerationBody`) with OpenAI's fields mapped onto H3's: `model` checked against the served
    one, `size` -> `aspect_ratio`, `input_reference` (a file already in `uploads["image"]`, or a data URL that
    `save_image(bytes) -> Path` stores) -> the first keyframe of an fl2va job. Raises `RequestError` naming the
    field."""
    update = {}
    if request.model is not None and request.model != model_id:
        raise RequestError(
            f"model must be {model_id} (the model this server serves; got {request.model[:64]!r}).", "model"
        )
    if request.size is not None:
        if request.aspect_ratio is not None:
            raise RequestError("give size or aspect_ratio, not both.", "size")
        width, height = parse_size(request.size)
        if not MIN_ASPECT <= width / height <= MAX_ASPECT:
            raise nearest_size_error(width, height, canvas)
        update["aspect_ratio"] = f"{width}:{height}"
    reference = request.input_reference
    if reference is not None:
        if reference.file_id is not None:
            raise RequestError(
                "input_reference.file_id cannot be resolved: this server keeps no files; upload the "
                "image as the input_reference file or send it as a data: URL.",
                "input_reference",
            )
        if not reference.image_url:
            raise RequestError("input_reference needs image_url (a data: URL) or a file upload.", "input_reference")
        if "image" in uploads:
            raise RequestError("give input_reference or image, not both.", "input_reference")
        uploads["image"] = save_image(image_from_data_url(reference.image_url))
        update["input_reference"] = None  # the image is an upload now; the request keeps no copy of it
    if "image" in uploads and "task" not in request.model_fields_set:
        update["task"] = "fl2va"
    return request.model_copy(update=update)
