"""The UI's login page, in place of Gradio's: the user name stays after a wrong key, an empty user name is allowed
(any name will do), and every failure says what went wrong: a wrong key, the throttle's lock-out with its wait
counted down, a server that does not answer. It posts to Gradio's own `login` route, so the session cookie, the
key check and the server's back-off of wrong logins (`h3gen.server.middleware.LoginThrottle`) are unchanged."""

import html

from starlette.requests import Request
from starlette.responses import HTMLResponse

ANY_USER = "user"  # the name sent when the field is left empty: the server checks the key only

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>h3gen — log in</title>
<style>
body { font-family: system-ui, sans-serif; display: flex; justify-content: center; margin-top: 12vh; }
form { width: 22rem; display: flex; flex-direction: column; gap: 0.6rem; }
label { display: flex; flex-direction: column; gap: 0.2rem; font-size: 0.95rem; }
input { font-size: 1rem; padding: 0.45rem; }
button { font-size: 1rem; padding: 0.5rem; cursor: pointer; }
button:disabled { cursor: not-allowed; opacity: 0.6; }
#login-message { min-height: 3em; color: #b00020; }
#login-message.ok { color: inherit; }
</style></head>
<body><form id="login-form" autocomplete="on">
<h2>h3gen — MiniMax-H3</h2>
<p>{message}</p>
<label>User name (any)<input id="login-user" name="username" autocomplete="username"></label>
<label>API key<input id="login-key" name="password" type="password" autocomplete="current-password" required></label>
<button id="login-button" type="submit">Log in</button>
<div id="login-message" role="alert" aria-live="polite"></div>
</form>
<script>
const form = document.getElementById("login-form"), user = document.getElementById("login-user"),
  key = document.getElementById("login-key"), button = document.getElementById("login-button"),
  message = document.getElementById("login-message");
let timer = null;
function say(text, ok) { message.textContent = text; message.className = ok ? "ok" : ""; }
function lockOut(seconds) {
  clearInterval(timer);
  let left = Math.max(1, seconds);
  button.disabled = true;
  const tick = () => {
    if (left <= 0) { clearInterval(timer); button.disabled = false; say("You can try again now.", true); return; }
    say("Too many wrong logins from this address: try again in " + left + " s.");
    left -= 1;
  };
  tick();
  timer = setInterval(tick, 1000);
}
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!key.value) { say("Enter the server's API key."); key.focus(); return; }
  const body = new URLSearchParams({username: user.value.trim() || "{any_user}", password: key.value});
  button.disabled = true;
  say("Logging in…", true);
  let answer;
  try {
    answer = await fetch("login", {method: "POST", body: body, credentials: "same-origin"});
  } catch (error) {
    button.disabled = false;
    say("The server did not answer (" + error.message + "): check that it is running, then try again.");
    return;
  }
  if (answer.ok) { say("Logged in.", true); location.reload(); return; }
  let detail = "";
  try { detail = (await answer.json()).detail || ""; } catch (error) { detail = answer.statusText; }
  if (answer.status === 429) { lockOut(parseInt(answer.headers.get("retry-after") || "30", 10)); return; }
  button.disabled = false;
  if (answer.status === 400 || answer.status === 401 || answer.status === 403) {
    say("Wrong API key: the user name can be anything, the key must be the server's (its --api-key or "
      + "$H3GEN_API_KEY).");
  } else {
    say("Login failed (HTTP " + answer.status + (detail ? ": " + detail : "") + ").");
  }
  key.select();
});
user.focus();
</script></body></html>
"""


def login_page(message: str) -> str:
    """The page, with `message` (the server's login note) above the fields."""
    return PAGE.replace("{message}", html.escape(message)).replace("{any_user}", ANY_USER)


class LoginPage:
    """ASGI middleware for the UI: a GET of the UI's page by a browser that is not logged in gets `login_page`
    instead of Gradio's login form. `logged_in(request)` says whether a request carries a session."""

    def __init__(self, app, *, logged_in, message: str):
        self.app = app
        self.logged_in = logged_in
        self.page = login_page(message).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path not in ("", "/") or self.logged_in(Request(scope)):
            return await self.app(scope, receive, send)
        response = HTMLResponse(self.page, headers={"cache-control": "no-store"})
        await response(scope, receive, send)
