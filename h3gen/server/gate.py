"""The gate in front of every route: the API key first, then the size of the body, before any route reads it.

An unauthenticated request is answered 401 (or 429 while its client is backed off) without its body being read; an
authenticated one whose `Content-Length` is over its route's limit is answered 413 at once, and one that streams
past the limit is stopped there with a 413 (`BodyTooLarge`, which the app answers like any HTTP error). The routes
then parse what is left, bounded (`bodies`, `json_text`).
"""

import json
from collections.abc import Callable

from starlette.exceptions import HTTPException

from h3gen.server.openai_video import error_body


class BodyTooLarge(HTTPException):
    """A body that streamed past its route's limit (413)."""

    def __init__(self, limit: int):
        super().__init__(413, too_large(limit))


def too_large(limit: int) -> str:
    return f"request body larger than {limit} bytes"


async def send_error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    """Answer an HTTP request with the server's error shape (FastAPI's `detail`, OpenAI's `error`)."""
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    body = json.dumps({"detail": message, "error": error_body(message, kind=kind)}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """ASGI middleware: `authorize(scope)` for every path but `open_paths` and the UI's (which has its own login),
    then the body bounded by `body_limit(method, path, content_type)` bytes.

    `authorize` returns None to let the request in, or `(status, message, headers)` to refuse it."""

    def __init__(
        self,
        app,
        *,
        authorize: Callable,
        body_limit: Callable[[str, str, str], int],
        open_paths: tuple[str, ...] = ("/health",),
        ui_path: str = "/ui",
    ):
        self.app = app
        self.authorize = authorize
        self.body_limit = body_limit
        self.open_paths = open_paths
        self.ui_path = ui_path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        in_ui = path == self.ui_path or path.startswith(self.ui_path + "/")
        if not in_ui and path not in self.open_paths:
            refusal = self.authorize(scope)
            if refusal is not None:
                return await send_error(send, *refusal)
        headers = dict((name.lower(), value) for name, value in scope.get("headers", []))
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        limit = self.body_limit(scope.get("method", "GET"), path, content_type)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await send_error(send, 413, too_large(limit))

        received = 0
        started = False

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
        except BodyTooLarge:  # raised where no handler answered it (the UI's routes)
            if not started:
                await send_error(send, 413, too_large(limit))
