"""`POST /v1/prompts/plan`: a short idea -> an H3 prompt, with the server's K3 planner (as JSON, or as server-sent
events while it writes)."""

import asyncio
import json
import shutil
import threading

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from h3gen.errors import RequestError
from h3gen.pipelines.k3.planner import PlannerError
from h3gen.server.bodies import (MAX_JSON_BYTES, body_fields, field_error, public_text, save_upload,
                                 validated)
from h3gen.server.schemas import PlanRequest, PlanResponse


def _plan_body(result) -> dict:
    return {"prompt": result.prompt, "planned_prompt": result.planned, "backend": result.backend,
            "tokens": result.tokens, "seconds": result.seconds}


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


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


def add_plan_route(app: FastAPI, server) -> None:
    """Add `POST /v1/prompts/plan` to `app`; `server` is the app's `ServerContext`."""

    @app.post("/v1/prompts/plan", response_model=PlanResponse, dependencies=server.auth,
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
                return field_error(key, "unexpected file field; the only file is image")
            staging = server.manager.staging_dir()
            image = await run_in_threadpool(save_upload, upload, staging, "image", server.max_upload_bytes)
            return None

        try:
            data = await body_fields(request, server.max_upload_bytes + MAX_JSON_BYTES, max_files=1,
                                      max_fields=len(PlanRequest.model_fields) + 1, on_file=save)
            if isinstance(data, JSONResponse):
                return data
            plan = validated(PlanRequest, data)
            if isinstance(plan, JSONResponse):
                return plan
            planner = getattr(server.manager.engine, "planner", None)
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
            return field_error(error.field or "body", str(error))
        except PlannerError as error:
            return JSONResponse({"detail": public_text(str(error))}, status_code=424)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
