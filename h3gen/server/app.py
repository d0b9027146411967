"""The FastAPI app: `/v1/videos` jobs (create, status, content, cancel, list), `/v1/prompts/plan`, `/health`,
`/metrics` (`h3gen.ui` mounts the Gradio UI at `/ui` on top). Every bad request is a 4xx naming what was wrong; nothing a client sends reaches the engine
unvalidated, and no failure of one job affects another."""

import asyncio
import errno
import json
import logging
import re
import secrets
import shutil
import sqlite3
import sys
import threading
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from h3gen.errors import RequestError
from h3gen.media import upload_suffix
from h3gen.pipelines.h3.references import MAX_REFERENCES
from h3gen.pipelines.k3.planner import PlannerError
from h3gen.server.engine import upload_name
from h3gen.server.jobs import JobManager, QueueFull
from h3gen.server.middleware import LoginThrottle, SecurityHeaders, client_of
from h3gen.server.schemas import (IMAGE_FIELDS, REFERENCE_FIELDS, UPLOAD_KINDS, GenerationRequest, Health, JobCreated,
                                  JobList, JobView, PlanRequest, PlanResponse)
from h3gen.server.throttle import FailureThrottle

logger = logging.getLogger(__name__)

JOB_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_JSON_BYTES = 64 * 1024
# Request bodies are flat objects; deeper nesting is refused before parsing (Python's parser recurses per level).
MAX_JSON_DEPTH = 32
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
# The directories of an absolute path (kept: its last part), not when part of a URL or a word like "processor/".
_SERVER_PATH = re.compile(r"(?<![\w.:/~-])(?:/[^/\s'\"()<>,;]+)+/")
DISK_FULL = "the server's disk is full, so the request could not be stored; try again later"
_MULTIPART_FIELDS = tuple(GenerationRequest.model_fields)
_FILE_FIELDS = IMAGE_FIELDS + REFERENCE_FIELDS
MAX_FILES = len(IMAGE_FIELDS) + MAX_REFERENCES + 1  # one more, so a 13th reference gets the count's own message


def _plan_body(result) -> dict:
    return {"prompt": result.prompt, "planned_prompt": result.planned, "backend": result.backend,
            "tokens": result.tokens, "seconds": result.seconds}


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def public_text(text: str | None) -> str | None:
    """`text` as a client may see it: absolute paths reduced to their file names (the server's folders stay
    private). Every message the API answers with goes through here."""
    return None if text is None else _SERVER_PATH.sub("", text)


def _public_view(job: dict) -> dict:
    return {**job, "error": public_text(job.get("error"))}


def _json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests arrays/objects more than `limit` deep (brackets inside strings do not count)."""
    depth = 0
    for token in _JSON_TOKENS.finditer(body):
        bracket = token.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif bracket in (b"]", b"}"):
            depth -= 1
    return False


def _insufficient_storage() -> JSONResponse:
    return JSONResponse({"detail": DISK_FULL}, status_code=507)


def _disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (
        isinstance(error, sqlite3.OperationalError) and "full" in str(error))


class _StrictMultiPartParser(MultiPartParser):
    """Starlette's parser, except that a text part which is not valid in the form's charset (UTF-8 unless the
    Content-Type says otherwise) is noted instead of being read as Latin-1, as JSON bodies refuse it too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.undecodable: list[str] = []

    def on_part_end(self) -> None:
        if self._current_part.file is None:
            try:
                self._current_part.data.decode(self._charset)
            except (UnicodeDecodeError, LookupError):
                self.undecodable.append(self._current_part.field_name)
        super().on_part_end()


async def _plan_events(planner, prompt: str, options: dict, staging):
    """Run `planner.plan` in a worker thread and answer with server-sent events (`delta`, then `done` or `error`).
    Errors before any text (a bad field, an unreadable image, no backend) are answered as plain JSON errors instead;
    a client that goes away cancels the planning. `staging` (the upload folder) is removed when the plan ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def put(item):
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work():
        try:
            put(("done", planner.plan(prompt, on_text=lambda text: put(("delta", text)), cancel=cancel, **options)))
        except Exception as error:  # noqa: BLE001 - every failure becomes an answer, never a dead stream
            put(("error", error))
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    worker = loop.run_in_executor(None, work)
    first = await queue.get()
    if first[0] == "error":
        await worker
        error = first[1]
        if isinstance(error, RequestError):
            return _field_error(error.field or "body", str(error))
        if isinstance(error, PlannerError):
            return JSONResponse({"detail": public_text(str(error))}, status_code=424)
        raise error

    async def events():
        item = first
        try:
            while True:
                kind, value = item
                if kind == "delta":
                    yield _sse("delta", {"text": value})
                elif kind == "done":
                    yield _sse("done", _plan_body(value))
                    return
                else:
                    status = 422 if isinstance(value, RequestError) else 424 if isinstance(value, PlannerError) else 500
                    yield _sse("error", {"detail": public_text(str(value)), "status": status})
                    return
                item = await queue.get()
        finally:
            cancel.set()  # no-op when the plan is done; stops it when the client left

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _json_object(request: Request) -> dict | JSONResponse:
    """The JSON object of a request body, or the 422 that says why there is none."""
    body = await _read_limited(request, MAX_JSON_BYTES)
    if _json_too_deep(body):
        return _field_error("body", f"the body nests arrays or objects more than {MAX_JSON_DEPTH} deep", "json_invalid")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _field_error("body", "the body is not valid JSON", "json_invalid")
    except RecursionError:
        return _field_error("body", "the body nests arrays or objects too deep", "json_invalid")
    except ValueError:  # an integer past Python's digit limit
        return _field_error("body", f"a number in the body has more than {sys.get_int_max_str_digits()} digits",
                            "json_invalid")
    if not isinstance(data, dict):
        return _field_error("body", "the body must be a JSON object", "model_type")
    return data


async def _multipart_form(request: Request, limit: int, *, max_files: int, max_fields: int):
    """The form of a multipart body no larger than `limit` bytes (411 without a Content-Length, 413 above it)."""
    declared = request.headers.get("content-length")
    if declared is None:
        raise HTTPException(411, "multipart uploads need a Content-Length")
    if not declared.isdigit() or int(declared) > limit:
        raise HTTPException(413, f"request body larger than {limit} bytes")
    async with aclosing(request.stream()) as stream:
        parser = _StrictMultiPartParser(request.headers, stream, max_files=max_files, max_fields=max_fields,
                                        max_part_size=MAX_JSON_BYTES)
        try:
            form = await parser.parse()
        except MultiPartException as error:
            raise HTTPException(400, error.message) from None
    if parser.undecodable:
        await form.close()
        field = parser.undecodable[0]
        raise RequestError(f"{field} is not valid text in the form's charset ({parser._charset}).", field)
    return form


async def _body_fields(request: Request, limit: int, *, max_files: int, max_fields: int, on_file,
                       file_fields: tuple[str, ...] = ()) -> dict | JSONResponse:
    """The fields of a JSON object body, or of a multipart body no larger than `limit` bytes whose files go to
    `await on_file(key, upload)` (which returns a 422 to stop, or None); a text value under one of `file_fields` is
    refused. A JSONResponse for a body that cannot be read; 415 for any other content type."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("application/json"):
        return await _json_object(request)
    if not content_type.startswith("multipart/form-data"):
        raise HTTPException(415, "send application/json or multipart/form-data")
    form = await _multipart_form(request, limit, max_files=max_files, max_fields=max_fields)
    data, seen = {}, set()
    try:
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                refusal = await on_file(key, value)
                if refusal is not None:
                    return refusal
            elif key in file_fields:
                return _field_error(key, f"{key} must be a file upload")
            elif key in seen:
                return _field_error(key, f"give {key} once (the form repeats it)")
            else:
                seen.add(key)
                if value != "":
                    data[key] = value
    finally:
        await form.close()
    return data


def _validated(schema, data: dict):
    """`schema` (a pydantic model) validated from `data`, or a 422 in FastAPI's own shape (locations under
    "body")."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        details = error.errors(include_url=False, include_context=False, include_input=False)
        for detail in details:
            detail["loc"] = ["body", *detail["loc"]]
        return JSONResponse({"detail": jsonable_encoder(details)}, status_code=422)


def _field_error(field: str, message: str, kind: str = "value_error") -> JSONResponse:
    return JSONResponse({"detail": [{"loc": ["body", field], "msg": public_text(message), "type": kind}]},
                        status_code=422)


def _request_body_schema() -> dict:
    json_schema = GenerationRequest.model_json_schema()
    multipart = json.loads(json.dumps(json_schema))
    multipart["additionalProperties"] = False
    for name in IMAGE_FIELDS:
        multipart["properties"][name] = {"type": "string", "format": "binary", "description": f"fl2va {name} file"}
    for name in REFERENCE_FIELDS:
        multipart["properties"][name] = {
            "type": "array", "items": {"type": "string", "format": "binary"},
            "description": f"ref2va {name.split('_')[1]} reference files (repeat the part; parts keep their order)"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": json_schema},
                                                          "multipart/form-data": {"schema": multipart}}}}


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413, f"request body larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"request body larger than {limit} bytes")
    return bytes(body)


def _save_upload(upload: UploadFile, folder: Path, name: str, limit: int, field: str | None = None) -> Path:
    """Store one uploaded file as `<name><suffix>`, the suffix from what its content decodes as (never from the
    client's file name). Raises `RequestError` naming `field` for a file too large, empty, or not of the field's
    kind (`UPLOAD_KINDS`), and lets `OSError` through (the disk being full is answered with 507)."""
    field = field or name
    received = folder / f"{name}.upload"
    size = 0
    with open(received, "wb") as out:
        while chunk := upload.file.read(1 << 20):
            size += len(chunk)
            if size > limit:
                raise RequestError(f"{field} is larger than the {limit // 2**20} MB upload limit.", field)
            out.write(chunk)
    if size == 0:
        raise RequestError(f"{field} is an empty file.", field)
    target = folder / f"{name}{upload_suffix(received, UPLOAD_KINDS[field], field)}"
    received.replace(target)
    return target


def create_app(manager: JobManager, *, api_key: str | None = None, max_upload_bytes: int = 20 * 2**20,
               model_name: str = "", throttle: FailureThrottle | None = None) -> FastAPI:
    """The service around `manager`. With `api_key`, every route but `/health` needs `Authorization: Bearer`
    (`/docs`, `/redoc` and `/openapi.json` too), and wrong keys and wrong UI logins (the web UI is mounted on top by
    `h3gen.ui.mount_ui`) are backed off per client by `throttle`. `/health` shows readiness to anyone, the rest
    (model, devices, queue, running job, load error) only to a caller with the key."""
    throttle = throttle or FailureThrottle()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manager._thread is None:
            manager.start()
        yield
        manager.stop()

    # The documentation routes are added below, behind the key like every other route.
    app = FastAPI(title="h3gen", version=__import__("h3gen").__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None,
                  description="MiniMax-H3 video + stereo audio generation. Jobs return MP4 (H.264 + AAC).")
    app.add_middleware(LoginThrottle, throttle=throttle)
    app.add_middleware(SecurityHeaders)

    def key_state(request: Request) -> str:
        """"open" (no key configured), "valid", "missing", "wrong" (counted) or "locked" (backing off)."""
        if api_key is None:
            return "open"
        header = request.headers.get("authorization")
        if header is None:
            return "missing"
        client = client_of(request.scope)
        if throttle.retry_after(client) is not None:
            return "locked"
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
            throttle.success(client)
            return "valid"
        throttle.failure(client)
        return "wrong"

    def require_key(request: Request) -> None:
        state = key_state(request)
        if state == "locked":
            wait = throttle.retry_after(client_of(request.scope)) or 1
            raise HTTPException(429, f"too many wrong API keys from this client; try again in {wait} s",
                                headers={"Retry-After": str(wait)})
        if state in ("missing", "wrong"):
            raise HTTPException(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_key)]

    def queue_full(retry_after: int) -> JSONResponse:
        return JSONResponse({"detail": f"the queue is full ({manager.max_queue} jobs waiting); try again later"},
                            status_code=429, headers={"Retry-After": str(retry_after)})

    def job_or_404(job_id: str) -> dict:
        job = manager.get(job_id) if JOB_ID.match(job_id) else None
        if job is None:
            raise HTTPException(404, f"no job {job_id[:64]!r}")
        return job

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):  # never a traceback to the client
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal server error"}, status_code=500)

    # Answered here rather than by the catch-all above, so that the connection stays open.
    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.OperationalError)
    async def storage_error(request: Request, error: Exception):
        if _disk_full(error):
            logger.error("disk full on %s %s: %s", request.method, request.url.path, error)
            return _insufficient_storage()
        logger.exception("storage error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal server error"}, status_code=500)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return _field_error(error.field or "body", str(error))

    @app.post("/v1/videos", status_code=202, response_model=JobCreated, dependencies=auth,
              openapi_extra=_request_body_schema(),
              responses={413: {"description": "body or upload too large"}, 415: {"description": "unsupported body"},
                         422: {"description": "invalid field"}, 429: {"description": "queue full"}})
    async def create_video(request: Request):
        """Validate a generation request (JSON, or multipart with `image` / `last_image` files, or with `ref_image` /
        `ref_video` / `ref_audio` files for ref2va, each repeatable: the order of the parts is the order of the
        references) and queue it. A full queue is answered (429) before any upload is read."""
        if manager.queue_depth() >= manager.max_queue:
            return queue_full(manager.retry_after())
        staging = None
        uploads: dict[str, Path] = {}
        references = 0

        async def save(key: str, upload: UploadFile):
            nonlocal staging, references
            if key not in _FILE_FIELDS:
                return _field_error(key, f"unexpected file field; files go in {', '.join(_FILE_FIELDS)}")
            if key in uploads:
                return _field_error(key, f"give {key} once")
            name = key
            if key in REFERENCE_FIELDS:
                name, references = upload_name(key, references), references + 1
            staging = staging or manager.staging_dir()
            uploads[name] = await run_in_threadpool(_save_upload, upload, staging, name, max_upload_bytes, key)
            return None

        try:
            data = await _body_fields(request, max_upload_bytes * MAX_FILES + MAX_JSON_BYTES, max_files=MAX_FILES,
                                      max_fields=len(_MULTIPART_FIELDS) + 4, on_file=save, file_fields=_FILE_FIELDS)
            if isinstance(data, JSONResponse):
                return data
            generation = _validated(GenerationRequest, data)
            if isinstance(generation, JSONResponse):
                return generation
            normalized = await run_in_threadpool(manager.engine.validate, generation, uploads)
            job = manager.submit(normalized, uploads)
            staging = None if uploads else staging
            return JSONResponse({"id": job["id"], "status": job["status"], "created_at": job["created_at"]},
                                status_code=202)
        except RequestError as error:
            return _field_error(error.field or "body", str(error))
        except QueueFull as error:
            return queue_full(error.retry_after)
        except (OSError, sqlite3.OperationalError) as error:
            if not _disk_full(error):
                raise
            logger.error("disk full while storing a request: %s", error)
            return _insufficient_storage()
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    @app.post("/v1/prompts/plan", response_model=PlanResponse, dependencies=auth,
              responses={200: {"description": "the planned prompt; with `stream: true` server-sent events",
                               "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                         409: {"description": "the server has no planner"}, 413: {"description": "too large"},
                         415: {"description": "unsupported body"}, 422: {"description": "invalid field"},
                         424: {"description": "the planner backend failed"}})
    async def plan_prompt(request: Request):
        """Turn a short idea into an H3 prompt (picture, motion, camera, sound, music, dialogue) with the server's
        planner. JSON `PlanRequest`, or multipart with its fields and an optional `image` file for a planner that
        reads images."""
        staging, image = None, None

        async def save(key: str, upload: UploadFile):
            nonlocal staging, image
            if key != "image":
                return _field_error(key, "unexpected file field; the only file is image")
            staging = manager.staging_dir()
            image = await run_in_threadpool(_save_upload, upload, staging, "image", max_upload_bytes)
            return None

        try:
            data = await _body_fields(request, max_upload_bytes + MAX_JSON_BYTES, max_files=1,
                                      max_fields=len(PlanRequest.model_fields) + 1, on_file=save)
            if isinstance(data, JSONResponse):
                return data
            plan = _validated(PlanRequest, data)
            if isinstance(plan, JSONResponse):
                return plan
            planner = getattr(manager.engine, "planner", None)
            if planner is None:
                raise HTTPException(409, "this server has no prompt planner; start it with --planner tiny|<K3 "
                                         "folder>|<OpenAI-compatible base URL>")
            options = dict(image=image, max_tokens=plan.max_tokens, seed=plan.seed, temperature=plan.temperature)
            if plan.stream:
                response = await _plan_events(planner, plan.prompt, options, staging)
                staging = None  # the stream removes it when it ends
                return response
            return _plan_body(await run_in_threadpool(planner.plan, plan.prompt, **options))
        except RequestError as error:
            return _field_error(error.field or "body", str(error))
        except PlannerError as error:
            return JSONResponse({"detail": public_text(str(error))}, status_code=424)
        except OSError as error:
            if not _disk_full(error):
                raise
            logger.error("disk full while storing an upload: %s", error)
            return _insufficient_storage()
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    @app.get("/v1/videos", response_model=JobList, dependencies=auth)
    def list_videos(limit: int = Query(20, ge=1, le=100), after: str | None = Query(None, max_length=64),
                    order: str = Query("desc", pattern="^(asc|desc)$")):
        """Jobs, newest first by default; page with `after` = the last id of the previous page."""
        if after is not None and not JOB_ID.match(after):
            raise HTTPException(404, f"no job {after!r}")
        jobs, has_more = manager.list(limit=limit, after=after, newest_first=order == "desc")
        jobs = [_public_view(job) for job in jobs]
        return {"data": jobs, "has_more": has_more, "last_id": jobs[-1]["id"] if jobs else None}

    @app.get("/v1/videos/{job_id}", response_model=JobView, dependencies=auth)
    def get_video(job_id: str):
        """Status, progress (0-100), current stage, stage timings, error and the normalized request."""
        return _public_view(job_or_404(job_id))

    @app.get("/v1/videos/{job_id}/content", dependencies=auth, response_class=FileResponse,
             responses={200: {"content": {"video/mp4": {}}}, 206: {"description": "partial content (Range)"},
                        404: {"description": "unknown job"}, 409: {"description": "not ready or failed"},
                        410: {"description": "cancelled"}})
    def get_content(job_id: str):
        """The MP4 (H.264 + AAC stereo); supports `Range` requests."""
        job = job_or_404(job_id)
        if job["status"] == "cancelled":
            raise HTTPException(410, "the job was cancelled; it has no video")
        if job["status"] == "failed":
            raise HTTPException(409, f"the job failed: {public_text(job['error'])}")
        if job["status"] != "succeeded":
            raise HTTPException(409, f"the job is {job['status']} ({job['progress']:.0f}%); try again later")
        path = manager.result_path(job_id)
        if path is None or not path.exists():
            raise HTTPException(404, "the video file is gone (removed by retention)")
        return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")

    @app.delete("/v1/videos/{job_id}", dependencies=auth)
    def delete_video(job_id: str):
        """Cancel a queued job, or a running one at its next step; a finished job is deleted. Files go too."""
        job_or_404(job_id)
        view = manager.cancel(job_id)
        if view is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return _public_view(view)

    @app.get("/health", response_model=Health, response_model_exclude_unset=True)
    def health(request: Request):
        """Liveness and readiness (no key needed); with the key also the model, devices, queue depth, running job
        and any load error."""
        readiness = {"status": "ok", "ready": manager.engine.ready}
        if key_state(request) not in ("open", "valid"):
            return readiness
        return readiness | {"model": Path(model_name or manager.engine.model_path).name,
                            "devices": manager.engine.devices(), "queue_depth": manager.queue_depth(),
                            "running": manager.running, "load_error": public_text(manager.engine.load_error)}

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    def openapi_schema():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    def swagger_docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=auth)
    def redoc_docs():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=auth)
    def metrics():
        """Prometheus metrics: queue depth, jobs by status, step and stage durations."""
        text = manager.metrics.render(queue_depth=manager.queue_depth(),
                                      jobs_by_status=manager.store.count_by_status(), ready=manager.engine.ready)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
