"""`POST /v1/prompts/plan`: a short idea -> an H3 prompt, with the server's K3 planner (as JSON, or as server-sent
events while it writes)."""

import asyncio
import json
import math
import shutil
import threading
import time

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from h3gen.errors import RequestError
from h3gen.pipelines.k3.planner import PlannerError
from h3gen.server.bodies import MAX_JSON_BYTES, body_fields, field_error, public_text, save_upload, validated
from h3gen.server.schemas import PlanRequest, PlanResponse


class PlanAdmission:
    """Bounded planning: at most `concurrency` plans run at once and `waiting` more wait for a turn; past that a
    request is refused (429 with `Retry-After`) before its body is read. A plan is one long model call, so an
    unbounded burst of them would hold the planner's device and the server's threads for minutes."""

    def __init__(self, concurrency: int = 1, waiting: int = 4):
        self.concurrency, self.capacity = concurrency, concurrency + waiting
        self.turns = threading.BoundedSemaphore(concurrency)
        self.admitted = 0
        self.lock = threading.Lock()
        self.recent: list[float] = []  # seconds of the latest plans

    def admit(self) -> None:
        """Take a place, or raise the 429 that says when to come back."""
        with self.lock:
            if self.admitted >= self.capacity:
                typical = sorted(self.recent)[len(self.recent) // 2] if self.recent else 10.0
                # The plans ahead finish in turns of `concurrency`; the first place opens after the first turn.
                wait = max(1, math.ceil(typical * (self.admitted - self.capacity + 1) / self.concurrency))
                raise HTTPException(
                    429,
                    f"{self.admitted} prompt plans are running or waiting, as many as this "
                    f"server takes; try again in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self.admitted += 1

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1

    def run(self, plan, *args, **kwargs):
        """`plan(*args, **kwargs)` once a turn is free (in a worker thread), timed."""
        with self.turns:
            start = time.monotonic()
            try:
                return plan(*args, **kwargs)
            finally:
                with self.lock:
                    self.recent = (self.recent + [time.monotonic() - start])[-16:]


def _plan_body(result) -> dict:
    return {
        "prompt": result.prompt,
        "planned_prompt": result.planned,
        "backend": result.backend,
        "tokens": result.tokens,
        "seconds": result.seconds,
    }


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def _plan_events(planner, prompt: str, options: dict, staging, admission: PlanAdmission):
    """Run `planner.plan` in a worker thread (in its turn of `admission`, whose place it gives back when done) and
    answer with server-sent events (`delta`, then `done` or `error`). Errors before any text (a bad field, an
    unreadable image, no backend) are answered as plain JSON errors instead; a client that goes away cancels the
    planning. `staging` (the upload folder) is removed when the plan ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def put(item):
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work():
        try:
            put(
                (
                    "done",
                    admission.run(
                        planner.plan, prompt, on_text=lambda text: put(("delta", text)), cancel=cancel, **options
                    ),
                )
            )
        except Exception as error:  # every failure becomes an answer, never a dead stream
            put(("error", error))
        finally:
            admission.release()
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    worker = loop.run_in_executor(None, work)
    first = await queue.get()
    if first[0] == "error":
        await worker
        error = first[1]
        if isinstance(error, RequestError):
            return field_error(error.field or "body", str(error))
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


def add_plan_route(app: FastAPI, server, admission: PlanAdmission | None = None) -> None:
    """Add `POST /v1/prompts/plan` to `app`; `server` is the app's `ServerContext`, `admission` bounds the plans
    running and waiting (default: one running, four waiting)."""
    admission = admission or PlanAdmission()

    @app.post(
        "/v1/prompts/plan",
        response_model=PlanResponse,
        responses={
            200: {
                "description": "the planned prompt; with `stream: true` server-sent events",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            409: {"description": "the server has no planner"},
            413: {"description": "too large"},
            415: {"description": "unsupported body"},
            422: {"description": "invalid field"},
            424: {"description": "the planner backend failed"},
            429: {"description": "as many plans running and waiting as the server takes"},
        },
    )
    async def plan_prompt(request: Request):
        """Turn a short idea into an H3 prompt (picture, motion, camera, sound, music, dialogue) with the server's
        planner. JSON `PlanRequest`, or multipart with its fields and an optional `image` file for a planner that
        reads images."""
        staging, image, admitted = None, None, False

        async def save(key: str, upload: UploadFile):
            nonlocal staging, image
            if key != "image":
                return field_error(key, "unexpected file field; the only file is image")
            staging = server.manager.staging_dir()
            image = await run_in_threadpool(save_upload, upload, staging, "image", server.max_upload_bytes)
            return None

        try:
            admission.admit()  # before the body is read: a refused plan costs nothing
            admitted = True
            data = await body_fields(
                request,
                server.max_upload_bytes + MAX_JSON_BYTES,
                max_files=1,
                max_fields=len(PlanRequest.model_fields) + 1,
                on_file=save,
            )
            if isinstance(data, JSONResponse):
                return data
            plan = await run_in_threadpool(validated, PlanRequest, data)
            if isinstance(plan, JSONResponse):
                return plan
            planner = getattr(server.manager.engine, "planner", None)
            if planner is None:
                raise HTTPException(
                    409,
                    "this server has no prompt planner; start it with --planner tiny|<K3 "
                    "folder>|<OpenAI-compatible base URL>",
                )
            options = dict(image=image, max_tokens=plan.max_tokens, seed=plan.seed, temperature=plan.temperature)
            if plan.stream:
                response = await _plan_events(planner, plan.prompt, options, staging, admission)
                staging, admitted = None, False  # the stream removes the folder and gives the place back
                return response
            return _plan_body(await run_in_threadpool(admission.run, planner.plan, plan.prompt, **options))
        except RequestError as error:
            return field_error(error.field or "body", str(error))
        except PlannerError as error:
            return JSONResponse({"detail": public_text(str(error))}, status_code=424)
        finally:
            if admitted:
                admission.release()
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
