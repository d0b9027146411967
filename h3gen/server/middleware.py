"""ASGI middleware of the server: security headers on every response, and the back-off of wrong UI logins."""

import json

from h3gen.server.throttle import FailureThrottle

# Nothing the API answers is meant to run in a browser: JSON, MP4, server-sent events (an MP4 opened directly
# plays in the browser's own media page, which needs media-src).
API_CSP = "default-src 'none'; media-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
# /docs and /redoc are FastAPI's HTML pages, which load Swagger UI / ReDoc from their CDN with an inline script.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; style-src 'self' "
    "'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com; font-src https://fonts.gstatic.com; "
    "img-src 'self' data: https://fastapi.tiangolo.com https://cdn.redoc.ly; worker-src blob:; "
    "frame-ancestors 'none'; base-uri 'none'"
)
DOCS_PATHS = ("/docs", "/redoc")


def client_of(scope) -> str:
    """The address a request came from (what the throttle counts by)."""
    client = scope.get("client")
    return client[0] if client else "unknown"


class SecurityHeaders:
    """`X-Content-Type-Options: nosniff` on every response (no browser guesses a type from content); outside the
    UI, which sets its own, a `Content-Security-Policy` that forbids scripts and framing."""

    def __init__(self, app, ui_path: str = "/ui"):
        self.app = app
        self.ui_path = ui_path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        in_ui = path == self.ui_path or path.startswith(self.ui_path + "/")
        policy = None if in_ui else DOCS_CSP if path in DOCS_PATHS else API_CSP

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                if b"x-content-type-options" not in names:
                    headers.append((b"x-content-type-options", b"nosniff"))
                if policy and b"content-security-policy" not in names:
                    headers.append((b"content-security-policy", policy.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class LoginThrottle:
    """Backs off a client's wrong logins on the UI's login route (`POST <ui>/login`, Gradio's, which answers 400
    for wrong credentials and 200 for right ones): while it is locked out it gets 429 with `Retry-After`."""

    def __init__(self, app, throttle: FailureThrottle, login_paths: tuple[str, ...] = ("/ui/login", "/ui/login/")):
        self.app = app
        self.throttle = throttle
        self.login_paths = login_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.login_paths:
            return await self.app(scope, receive, send)
        client = client_of(scope)
        wait = self.throttle.retry_after(client)
        if wait is not None:
            body = json.dumps({"detail": f"too many wrong logins; try again in {wait} s"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"retry-after", str(wait).encode()),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return

        async def watch(message):
            if message["type"] == "http.response.start":
                if message["status"] in (400, 401, 403):
                    self.throttle.failure(client)
                elif 200 <= message["status"] < 300:
                    self.throttle.success(client)
            await send(message)

        await self.app(scope, receive, watch)
