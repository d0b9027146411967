"""The `/v1/videos` routes (OpenAI's video API: create, retrieve, list, content with its variants, remix, delete)
and `GET /v1/models`. Every answer about a job is its `Video` object (`openai_video.video_object`)."""

import shutil
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile

from h3gen.media import MediaError, mp4_spritesheet, mp4_thumbnail
from h3gen.pipelines.h3 import MAX_REFERENCES
from h3gen.server import openai_video
from h3gen.server.bodies import (
    MAX_JSON_BYTES,
    body_fields,
    field_error,
    json_body_limit,
    json_object,
    public_text,
    public_view,
    save_upload,
    validated,
)
from h3gen.server.engine import upload_name
from h3gen.server.job import JobStatus
from h3gen.server.jobs import QueueFull
from h3gen.server.schemas import (
    IMAGE_FIELDS,
    REFERENCE_FIELDS,
    GenerationBody,
    RemixRequest,
    VideoDeleted,
    VideoList,
    VideoObject,
    request_body_schema,
)

_MULTIPART_FIELDS = tuple(GenerationBody.model_fields)
_FILE_FIELDS = IMAGE_FIELDS + REFERENCE_FIELDS + ("input_reference",)
MAX_FILES = len(IMAGE_FIELDS) + MAX_REFERENCES + 1  # one more, so a 13th reference gets the count's own message


def _data_url_bytes(data: dict) -> int:
    """The bytes of a JSON body's `input_reference.image_url` (a keyframe carried as a data URL)."""
    reference = data.get("input_reference")
    url = reference.get("image_url") if isinstance(reference, dict) else None
    return len(url.encode()) if isinstance(url, str) else 0


def add_video_routes(app: FastAPI, server) -> None:
    """Add the `/v1/videos` routes and `GET /v1/models` to `app`; `server` is the app's `ServerContext`."""
    manager = server.manager

    def as_video(view: dict) -> dict:
        return openai_video.video_object(
            public_view(view), model=server.model_id, retention_seconds=manager.retention_seconds
        )

    def job_or_404(job_id: str) -> dict:
        job = manager.get(job_id) if server.job_id_pattern.match(job_id) else None
        if job is None:
            raise HTTPException(404, f"no video {job_id[:64]!r}")
        return job

    def submit(generation: GenerationBody, uploads: dict[str, Path], staging_dir, extra: dict | None = None):
        """Map OpenAI's fields, validate against the model and queue: the job's `Video` object."""

        def save_image(data: bytes) -> Path:
            path = staging_dir() / "image.upload"
            path.write_bytes(data)
            return path

        generation = openai_video.openai_fields(
            generation, uploads, model_id=server.model_id, canvas=manager.engine.canvas, save_image=save_image
        )
        normalized = manager.engine.validate(generation, uploads) | (extra or {})
        return as_video(manager.submit(normalized, uploads))

    @app.post(
        "/v1/videos",
        status_code=202,
        response_model=VideoObject,
        openapi_extra=request_body_schema(),
        responses={
            413: {"description": "body or upload too large"},
            415: {"description": "unsupported body"},
            422: {"description": "invalid field"},
            429: {"description": "queue full"},
        },
    )
    async def create_video(request: Request):
        """Validate a generation request and queue it; answers the job's `Video` object. JSON, or multipart (as
        OpenAI's SDK sends it) with an `input_reference` or `image` / `last_image` files (fl2va), or `ref_image` /
        `ref_video` / `ref_audio` files (ref2va), each repeatable: the order of the parts is the order of the
        references. A full queue is answered (429) before any upload is read."""
        if manager.queue_depth() >= manager.max_queue:
            raise QueueFull(manager.retry_after())
        staging = None
        uploads: dict[str, Path] = {}
        references = 0

        def staging_dir() -> Path:
            nonlocal staging
            staging = staging or manager.staging_dir()
            return staging

        async def save(key: str, upload: UploadFile):
            nonlocal references
            if key not in _FILE_FIELDS:
                return field_error(key, f"unexpected file field; files go in {', '.join(_FILE_FIELDS)}")
            name = "image" if key == "input_reference" else key
            if name in uploads:
                return field_error(
                    key,
                    "give one first frame: image or input_reference, once" if name == "image" else f"give {key} once",
                )
            if key in REFERENCE_FIELDS:
                name, references = upload_name(key, references), references + 1
            uploads[name] = await run_in_threadpool(
                save_upload, upload, staging_dir(), name, server.max_upload_bytes, key
            )
            return None

        try:
            data = await body_fields(
                request,
                server.max_upload_bytes * MAX_FILES + MAX_JSON_BYTES,
                max_files=MAX_FILES,
                max_fields=len(_MULTIPART_FIELDS) + 4,
                on_file=save,
                file_fields=_FILE_FIELDS,
                text_limit=json_body_limit(server.max_upload_bytes),
                json_allowance=_data_url_bytes,
            )
            if isinstance(data, JSONResponse):
                return data
            generation = await run_in_threadpool(validated, GenerationBody, data)  # JSON fields parse off the loop
            if isinstance(generation, JSONResponse):
                return generation
            video = await run_in_threadpool(submit, generation, uploads, staging_dir)
            staging = None if uploads else staging
            return JSONResponse(video, status_code=202)
        finally:  # a RequestError or QueueFull is answered by the app's handlers (422, 429)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    @app.post(
        "/v1/videos/{job_id}/remix",
        status_code=202,
        response_model=VideoObject,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": RemixRequest.model_json_schema()}},
            }
        },
        responses={
            404: {"description": "unknown video"},
            409: {"description": "its files are gone"},
            422: {"description": "invalid field"},
            429: {"description": "queue full"},
        },
    )
    async def remix_video(job_id: str, request: Request):
        """A new job with the source video's settings (task, canvas, length, seed, steps, keyframes and references)
        and a new prompt (JSON `RemixRequest`); `remixed_from_video_id` names the source."""
        data = await json_object(request)
        if isinstance(data, JSONResponse):
            return data
        remix = validated(RemixRequest, data)
        if isinstance(remix, JSONResponse):
            return remix
        return await run_in_threadpool(remix_job, job_id, remix)

    def remix_job(job_id: str, remix: RemixRequest) -> JSONResponse:
        job_or_404(job_id)
        source = manager.store.get(job_id)
        # The normalized request holds both step counts resolved; num_inference_steps alone carries them over.
        settings = {
            name: value
            for name, value in source.request.items()
            if name in GenerationBody.model_fields and name not in ("prompt", "plan", "input_reference", "forwards")
        }
        if settings.get("size"):  # the normalized request holds the aspect ratio the size was mapped to
            settings.pop("aspect_ratio", None)
        staging = manager.staging_dir()
        try:
            uploads = {}
            for name, path in source.uploads.items():
                if not Path(path).exists():
                    raise HTTPException(409, "the source video's uploaded files are gone; create a new video instead")
                uploads[name] = staging / Path(path).name
                shutil.copyfile(path, uploads[name])
            generation = GenerationBody.model_validate(settings | {"prompt": remix.prompt})
            video = submit(generation, uploads, lambda: staging, {"remixed_from_video_id": job_id})
            return JSONResponse(video, status_code=202)
        finally:  # a RequestError or QueueFull is answered by the app's handlers (422, 429)
            shutil.rmtree(staging, ignore_errors=True)

    @app.get("/v1/videos", response_model=VideoList)
    def list_videos(
        limit: int = Query(20, ge=1, le=100),
        after: str | None = Query(None, max_length=64),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ):
        """Videos, newest first by default; page with `after` = `last_id` of the previous page."""
        if after is not None and not server.job_id_pattern.match(after):
            raise HTTPException(404, f"no video {after!r}")
        jobs, has_more = manager.list(limit=limit, after=after, newest_first=order == "desc")
        return {
            "object": "list",
            "data": [as_video(job) for job in jobs],
            "has_more": has_more,
            "first_id": jobs[0]["id"] if jobs else None,
            "last_id": jobs[-1]["id"] if jobs else None,
        }

    @app.get("/v1/videos/{job_id}", response_model=VideoObject)
    def get_video(job_id: str):
        """OpenAI's `Video` object, with H3's stage, stage timings, canvas and normalized request; the
        `openai-poll-after-ms` header says when to look again (one measured denoising step)."""
        video = as_video(job_or_404(job_id))
        delay = openai_video.poll_after_ms(manager.metrics.mean_step_seconds())
        return JSONResponse(jsonable_encoder(video), headers={"openai-poll-after-ms": str(delay)})

    @app.get(
        "/v1/videos/{job_id}/content",
        response_class=FileResponse,
        responses={
            200: {"content": {"video/mp4": {}, "image/jpeg": {}}},
            206: {"description": "partial content (Range)"},
            404: {"description": "unknown job"},
            409: {"description": "not ready or failed"},
            410: {"description": "cancelled"},
            422: {"description": "unknown variant"},
        },
    )
    async def get_content(
        job_id: str,
        variant: str = Query(
            "video",
            max_length=16,
            description=(
                "video: the MP4 (H.264 + AAC stereo; Range requests supported); thumbnail: a JPEG of the middle frame; "
                "spritesheet: a JPEG grid of frames (x-spritesheet-* headers give its layout); preview: while the job "
                "runs, a JPEG of the clip as it will come out (the latest one; 409 before the first)"
            ),
        ),
    ):
        """The MP4, or a picture of it; while the job runs, its latest preview."""
        if variant not in openai_video.VARIANTS:
            return field_error("variant", f"variant must be one of {', '.join(openai_video.VARIANTS)}", "enum")
        job = job_or_404(job_id)
        if variant == "preview":
            return preview_of(job)
        if job["status"] == JobStatus.CANCELLED:
            raise HTTPException(410, "the job was cancelled; it has no video")
        if job["status"] == JobStatus.FAILED:
            raise HTTPException(409, f"the job failed: {public_text(job['error'])}")
        if job["status"] != JobStatus.SUCCEEDED:
            raise HTTPException(
                409, f"the job is {openai_video.OPENAI_STATUS[job['status']]} ({job['progress']:.0f}%); try again later"
            )
        path = manager.result_path(job_id)
        if path is None or not path.exists():
            raise HTTPException(404, "the video file is gone (removed by retention)")
        if variant == "video":
            return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")
        try:
            if variant == "thumbnail":
                image, headers = await run_in_threadpool(mp4_thumbnail, path), {}
            else:
                image, layout = await run_in_threadpool(mp4_spritesheet, path)
                headers = {f"x-spritesheet-{name.replace('_', '-')}": str(value) for name, value in layout.items()}
        except MediaError:
            raise HTTPException(404, "the video file is gone or unreadable") from None
        return Response(image, media_type="image/jpeg", headers=headers)

    def preview_of(job: dict) -> Response:
        """The running job's latest preview JPEG; 409 before the first one and once the job is finished."""
        if job["status"] != JobStatus.RUNNING:
            state = openai_video.OPENAI_STATUS[job["status"]]
            after = "; its video is variant=video" if job["status"] == JobStatus.SUCCEEDED else ""
            raise HTTPException(409, f"the job is {state}: previews are made while it runs{after}")
        path = manager.files.preview(job["id"])
        try:
            image = path.read_bytes() if job.get("preview_at") else None
        except FileNotFoundError:  # the job finished between the two reads
            image = None
        if not image:
            raise HTTPException(409, f"no preview yet (the job is at {job['progress']:.0f}%); try again later")
        headers = {"cache-control": "no-store", "x-preview-made-at": f"{job['preview_at']:.3f}"}
        return Response(image, media_type="image/jpeg", headers=headers)

    @app.delete("/v1/videos/{job_id}", response_model=VideoDeleted)
    def delete_video(job_id: str):
        """Delete a finished video and its files (`deleted: true`); a queued job is cancelled, a running one at its
        next step (`deleted: false`: it reads as failed with `error.code` "cancelled" until deleted in turn).
        OpenAI's `VideoDeleteResponse`, with the video's state after the call under `video`."""
        job_or_404(job_id)
        view = manager.cancel(job_id)
        if view is None:
            raise HTTPException(404, f"no video {job_id!r}")
        return {"id": job_id, "object": "video.deleted", "deleted": bool(view.get("deleted")), "video": as_video(view)}

    @app.get("/v1/models")
    def list_models():
        """The served model (OpenAI's model list) and the tasks it answers."""
        return openai_video.model_list(server.model_id, manager.engine.tasks, server.created)
