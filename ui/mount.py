"""Mounting the web UI at `/ui` on the API server: the Gradio app, the one route that serves job videos to it, the
login, and the headers that keep user content from running as a page of the UI's origin.

What the UI can read: what a user uploaded through it (Gradio's upload folder) and, through `/ui/media/<job id>.mp4`,
the MP4 of a job the server holds (`/ui/media/<job id>.jpg`: a running job's latest preview). The results folder is
on Gradio's block list, so no Gradio route serves it."""

import os
import secrets
import tempfile

import gradio as gr
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, Response
from gradio.utils import get_upload_folder
from starlette.routing import Mount

from h3gen.server.app import JOB_ID
from h3gen.server.job import JobStatus
from h3gen.ui.blocks import CSS, build_ui
from h3gen.ui.login import LoginPage
from h3gen.ui.views import MEDIA_ROUTE, PREVIEW_ROUTE

UI_PATH = "/ui"
LOGIN_MESSAGE = "Enter any user name and the server's API key."
# The UI's pages: Gradio's own scripts and styles (it writes inline ones, and gradio 6's HTML component compiles its
# template with Function(), hence 'unsafe-eval'), media, uploads and API calls to this origin only, and never inside
# another site's frame.
PAGE_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; media-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
    "worker-src 'self' blob:; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'"
)
# Files (uploads, job videos): never a page that runs scripts, even if a browser were to render one.
FILE_POLICY = "default-src 'none'; media-src 'self'; sandbox; frame-ancestors 'none'"
FILE_PREFIXES = ("/gradio_api/file=", "/gradio_api/file/", "/file=", "/file/", MEDIA_ROUTE.split("{")[0])


class SecurityHeaders:
    """ASGI middleware for the UI's responses: `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY` and a
    Content-Security-Policy (`FILE_POLICY` for served files, `PAGE_POLICY` for everything else)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        policy = FILE_POLICY if path.startswith(FILE_PREFIXES) else PAGE_POLICY

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.lower() not in (b"content-security-policy", b"x-content-type-options", b"x-frame-options")
                ]
                headers += [
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"content-security-policy", policy.encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


UPLOADS_ALIAS = "/~h3gen-uploads~"  # what the browser sees in place of the upload folder's path


class UploadPaths:
    """ASGI middleware for the UI: the upload folder's real path never reaches the browser. Gradio answers an
    upload with the file's path on the server and the page sends that path back (in event data and in `/file=`
    URLs); here Gradio's API answers carry `UPLOADS_ALIAS` in its place (sent chunked, as their length changes)
    and requests get the real path back before Gradio reads them."""

    def __init__(self, app, folder: str):
        self.app = app
        self.real = folder.rstrip("/").encode()
        self.alias = UPLOADS_ALIAS.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "/gradio_api/" not in scope.get("path", ""):
            return await self.app(scope, receive, send)
        real, alias = self.real, self.alias
        if alias.decode() in scope["path"] or alias in scope.get("query_string", b""):
            path = scope["path"].replace(alias.decode(), real.decode())
            scope = {
                **scope,
                "path": path,
                "raw_path": path.encode(),
                "query_string": scope.get("query_string", b"").replace(alias, real),
            }
        is_file = "/file=" in scope["path"] or "/file/" in scope["path"]
        is_upload = scope["path"].endswith("/upload")
        read = False

        async def receive_real():
            # Event data is small JSON (the gate bounds it): read it whole, so no path is split between chunks.
            nonlocal read
            if read or is_upload:
                return await receive()
            chunks = []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            read = True
            return {"type": "http.request", "body": b"".join(chunks).replace(alias, real), "more_body": False}

        async def send_alias(message):
            if not is_file:
                if message["type"] == "http.response.start":
                    headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != b"content-length"]
                    message = {**message, "headers": headers}
                elif message["type"] == "http.response.body" and real in message.get("body", b""):
                    message = {**message, "body": message["body"].replace(real, alias)}
            await send(message)

        await self.app(scope, receive_real, send_alias)


def _gradio_app(app: FastAPI) -> FastAPI:
    return next(route.app for route in app.routes if isinstance(route, Mount) and route.path == UI_PATH)


def _logged_in(gradio_app, request: Request) -> bool:
    """Whether `request` carries a session of the UI's login, read as gradio's routes.get_current_user reads it (the
    token cookie Gradio's /login sets, looked up in the app's tokens)."""
    if gradio_app.auth is None:
        return True
    token = request.cookies.get(f"access-token-{gradio_app.cookie_id}") or request.cookies.get(
        f"access-token-unsecure-{gradio_app.cookie_id}"
    )
    return token is not None and gradio_app.tokens.get(token) is not None


def mount_ui(app: FastAPI, manager, *, api_key: str | None = None, max_upload_bytes: int = 20 * 2**20) -> FastAPI:
    """Mount the Gradio UI for `manager`'s jobs at `/ui` on `app` (the FastAPI app of `create_app`). With `api_key`,
    the UI's login page asks for it (any user name). Uploads are refused past `max_upload_bytes` (the server's
    --max-upload-mb, as on the REST API). Returns `app`.

    Gradio keeps user uploads in one folder that other Gradio apps on the host share (`/tmp/gradio`); unless the
    operator set `GRADIO_TEMP_DIR`, this server gets a private one (mode 0700) so that no other app's files are
    reachable through it."""
    if not os.environ.get("GRADIO_TEMP_DIR"):
        os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="h3gen-ui-")
    demo = build_ui(manager)
    login = (lambda _user, password: secrets.compare_digest(password.encode(), api_key.encode())) if api_key else None
    app = gr.mount_gradio_app(
        app,
        demo,
        path=UI_PATH,
        auth=login,
        allowed_paths=[],
        blocked_paths=[str(manager.results_dir.resolve())],
        run_history=False,
        auth_message=LOGIN_MESSAGE if api_key else None,
        max_file_size=max_upload_bytes,
        css=CSS,
    )
    # gradio's processing_utils._check_allowed, which keeps a request from naming a server file as an upload, only
    # runs once the Blocks "has launched"; `launch()` sets that, `mount_gradio_app` does not (gradio 6).
    demo.has_launched = True

    gradio_app = _gradio_app(app)

    def job_video(job_id: str, request: Request):
        """The MP4 of a finished job, by its id; 404 for anything else (unknown ids, other jobs' files, deleted)."""
        if not _logged_in(gradio_app, request):
            raise HTTPException(401, "log in to the UI first")
        job = manager.get(job_id) if JOB_ID.fullmatch(job_id) else None
        path = manager.result_path(job_id) if job and job["status"] == JobStatus.SUCCEEDED else None
        if path is None or not path.is_file():
            raise HTTPException(404, "no video for this job (it is unfinished, failed, cancelled or deleted)")
        return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4", content_disposition_type="inline")

    def job_preview(job_id: str, request: Request):
        """A running job's latest preview JPEG; 404 when it has none (not running, no preview yet, unknown)."""
        if not _logged_in(gradio_app, request):
            raise HTTPException(401, "log in to the UI first")
        job = manager.get(job_id) if JOB_ID.fullmatch(job_id) else None
        if job is None or job["status"] != JobStatus.RUNNING or not job.get("preview_at"):
            raise HTTPException(404, "no preview for this job (it is not running or has none yet)")
        try:
            image = manager.files.preview(job_id).read_bytes()
        except FileNotFoundError:
            raise HTTPException(404, "no preview for this job (it has just finished)") from None
        return Response(image, media_type="image/jpeg", headers={"cache-control": "no-store"})

    gradio_app.add_api_route(MEDIA_ROUTE, job_video, methods=["GET", "HEAD"], include_in_schema=False)
    gradio_app.add_api_route(PREVIEW_ROUTE, job_preview, methods=["GET"], include_in_schema=False)
    if api_key:
        gradio_app.add_middleware(
            LoginPage, logged_in=lambda request: _logged_in(gradio_app, request), message=LOGIN_MESSAGE
        )
    gradio_app.add_middleware(UploadPaths, folder=get_upload_folder())
    gradio_app.add_middleware(SecurityHeaders)
    return app
