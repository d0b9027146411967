"""The FastAPI app: authentication, error answers and middleware around the routes of `video_routes`
(`/v1/videos`, `/v1/models`, OpenAI's video API), `plan_routes` (`/v1/prompts/plan`) and `lora_routes`
(`/v1/loras`), plus `/health`, `/metrics` and the API documentation (`h3gen.ui` mounts the Gradio UI at `/ui` on
top). Every bad request is a 4xx naming what was wrong; nothing a client sends reaches the engine unvalidated, and
no failure of one job affects another."""

import logging
import re
import secrets
import sqlite3
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3gen.errors import RequestError
from h3gen.server import openai_video
from h3gen.server.bodies import (
    MAX_JSON_BYTES,
    disk_full,
    field_error,
    insufficient_storage,
    invalid,
    json_body_limit,
    public_text,
)
from h3gen.server.gate import RequestGate
from h3gen.server.job_files import JOB_ID
from h3gen.server.jobs import JobManager, QueueFull
from h3gen.server.lora_routes import add_lora_routes
from h3gen.server.middleware import LoginThrottle, SecurityHeaders, client_of
from h3gen.server.plan_routes import PlanAdmission, add_plan_route
from h3gen.server.schemas import Health
from h3gen.server.throttle import FailureThrottle
from h3gen.server.video_routes import MAX_FILES, add_video_routes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerContext:
    """What the route modules share: the job manager, the upload limit and the served model's name."""

    manager: JobManager
    max_upload_bytes: int
    model_id: str
    created: int  # Unix seconds, the model's `created` in GET /v1/models
    job_id_pattern: re.Pattern = JOB_ID


async def _internal_error(request: Request, error: Exception):  # never a traceback to the client
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        {
            "detail": "internal server error",
            "error": openai_video.error_body("internal server error", kind="server_error"),
        },
        status_code=500,
    )


async def _http_error(request: Request, error: StarletteHTTPException):
    return JSONResponse(
        {"detail": error.detail, "error": openai_video.error_body(str(error.detail))},
        status_code=error.status_code,
        headers=error.headers,
    )


async def _query_error(request: Request, error: RequestValidationError):
    # Never the client's input back (it may be megabytes): the field and what was wrong with it.
    details = [
        {key: value for key, value in detail.items() if key in ("loc", "msg", "type")} for detail in error.errors()
    ]
    return invalid(jsonable_encoder(details, custom_encoder={Exception: str}))


async def _storage_error(request: Request, error: Exception):
    if disk_full(error):
        logger.error("disk full on %s %s: %s", request.method, request.url.path, error)
        return insufficient_storage()
    logger.exception("storage error on %s %s", request.method, request.url.path)
    return JSONResponse({"detail": "internal server error"}, status_code=500)


async def _request_error(request: Request, error: RequestError):
    return field_error(error.field or "body", str(error))


async def _queue_full(request: Request, error: QueueFull):
    message = f"{error} (the queue holds as many jobs as the server takes)"
    return JSONResponse(
        {"detail": message, "error": openai_video.error_body(message, kind="rate_limit_error")},
        status_code=429,
        headers={"Retry-After": str(error.retry_after)},
    )


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answers in one shape (FastAPI's `detail`, OpenAI's `error`), never with a traceback; storage
    errors are answered here rather than by the catch-all, so that the connection stays open."""
    app.add_exception_handler(Exception, _internal_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(OSError, _storage_error)
    app.add_exception_handler(sqlite3.OperationalError, _storage_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(QueueFull, _queue_full)


def _add_service_routes(app: FastAPI, server: ServerContext, key_state, model_name: str) -> None:
    """`/health` (readiness for anyone, details with the key), the API documentation and `/metrics`."""
    manager = server.manager

    @app.get("/health", response_model=Health, response_model_exclude_unset=True)
    def health(request: Request):
        """Liveness and readiness (no key needed); with the key also the model, devices, queue depth, running job
        and any load error."""
        readiness = {"status": "ok", "ready": manager.ready}
        if key_state(request) not in ("open", "valid"):
            return readiness
        return readiness | {
            "model": Path(model_name or manager.engine.model_path).name,
            "devices": manager.engine.devices(),
            "queue_depth": manager.queue_depth(),
            "running": manager.running,
            "load_error": public_text(manager.engine.load_error),
            "workers": [
                {key: worker[key] for key in ("id", "host", "capabilities", "running_job")}
                for worker in manager.live_workers()
            ],
            "queue_by_task": manager.queue_by_task(),
        }

    @app.get("/openapi.json", include_in_schema=False)
    def openapi_schema():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def swagger_docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    def redoc_docs():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics():
        """Prometheus metrics: queue depth, jobs by status, step and stage durations."""
        text = manager.metrics.render(
            queue_depth=manager.queue_depth(),
            jobs_by_status=manager.store.count_by_status(),
            ready=manager.ready,
            queue_by_task=manager.queue_by_task(),
            workers_by_task=manager.workers_by_task(),
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


UI_BODY_BYTES = 2**20  # the UI's own calls (Gradio's queue and API): prompts and file references, no files


def body_limits(max_upload_bytes: int):
    """`(method, path, content_type) -> bytes` a request's body may hold: uploads by the upload limit, the UI's
    file uploads likewise, a JSON video request 64 KB besides its data URL (`json_body_limit`), every other body
    64 KB."""
    multipart = {
        "/v1/videos": max_upload_bytes * MAX_FILES + MAX_JSON_BYTES,
        "/v1/prompts/plan": max_upload_bytes + MAX_JSON_BYTES,
    }
    data_url = json_body_limit(max_upload_bytes)

    def limit(method: str, path: str, content_type: str) -> int:
        if path.startswith("/ui/"):
            return max_upload_bytes + MAX_JSON_BYTES if path.endswith("/upload") else UI_BODY_BYTES
        if content_type.startswith("multipart/form-data") and path in multipart:
            return multipart[path]
        return data_url if path == "/v1/videos" else MAX_JSON_BYTES

    return limit


def create_app(
    manager: JobManager,
    *,
    api_key: str | None = None,
    max_upload_bytes: int = 20 * 2**20,
    model_name: str = "",
    throttle: FailureThrottle | None = None,
    model_id: str = openai_video.DEFAULT_MODEL_ID,
    max_plan_queue: int = 4,
) -> FastAPI:
    """The service around `manager`. With `api_key`, every route but `/health` needs `Authorization: Bearer`
    (`/docs`, `/redoc` and `/openapi.json` too), and wrong keys and wrong UI logins (the web UI is mounted on top by
    `h3gen.ui.mount_ui`) are backed off per client by `throttle`. `/health` shows readiness to anyone, the rest
    (model, devices, queue, running job, load error) only to a caller with the key. `model_id` is the model's name
    in OpenAI's API (`model`, `GET /v1/models`). Prompt plans run one at a time with `max_plan_queue` more
    waiting; past that `POST /v1/prompts/plan` answers 429."""
    throttle = throttle or FailureThrottle()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not manager.started:
            manager.start()
        yield
        manager.stop()

    # The documentation routes are added below, behind the key like every other route.
    app = FastAPI(
        title="h3gen",
        version=__import__("h3gen").__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        description="MiniMax-H3 video + stereo audio generation. Jobs return MP4 (H.264 + AAC).",
    )

    def key_state(request: Request) -> str:
        """ "open" (no key configured), "valid", "missing", "wrong" (counted) or "locked" (backing off)."""
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

    def authorize(scope) -> tuple[int, str, dict] | None:
        """None for a request with the key (or a server without one), else the refusal `RequestGate` answers."""
        state = key_state(Request(scope))
        if state == "locked":
            wait = throttle.retry_after(client_of(scope)) or 1
            return 429, f"too many wrong API keys from this client; try again in {wait} s", {"Retry-After": str(wait)}
        if state in ("missing", "wrong"):
            return 401, "missing or wrong API key (send Authorization: Bearer <key>)", {"WWW-Authenticate": "Bearer"}
        return None

    # The last added runs first: security headers on every answer, then the UI's login back-off, then the key and
    # the body's size, checked before anything reads the body.
    app.add_middleware(RequestGate, authorize=authorize, body_limit=body_limits(max_upload_bytes))
    app.add_middleware(LoginThrottle, throttle=throttle)
    app.add_middleware(SecurityHeaders)
    _add_error_handlers(app)
    server = ServerContext(manager, max_upload_bytes, model_id, int(time.time()))
    add_video_routes(app, server)
    add_plan_route(app, server, PlanAdmission(concurrency=1, waiting=max_plan_queue))
    add_lora_routes(app, server)

    _add_service_routes(app, server, key_state, model_name)
    return app
