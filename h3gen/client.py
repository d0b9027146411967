"""A small Python client for the h3gen REST API.

client = H3Client("http://127.0.0.1:8000", api_key=None)
job = client.generate("a red fox in the snow", seconds=5, seed=7, out="fox.mp4")
job = client.generate("<Picture 1> sings <Audio 1>", references=["singer.png", "voice.wav"], out="song.mp4")
"""

import json
import time
from pathlib import Path

import httpx

# A reference's kind by its file suffix (pass `(kind, path)` for anything else).
REFERENCE_SUFFIXES = {
    "image": {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"},
    "video": {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".ts"},
    "audio": {".wav", ".mp3", ".m4a", ".aac", ".flac", ".ogg", ".opus", ".oga"},
}


def _reference_part(reference) -> tuple[str, Path]:
    """`path` or `(kind, path)` -> the form field (`ref_image` / `ref_video` / `ref_audio`) and the file."""
    if isinstance(reference, tuple):
        kind, path = reference
    else:
        path = Path(reference)
        kind = next((k for k, suffixes in REFERENCE_SUFFIXES.items() if path.suffix.lower() in suffixes), None)
        if kind is None:
            raise H3ClientError(
                f"cannot tell the kind of reference {path} from its suffix; pass (kind, path) with "
                "kind image, video or audio."
            )
    if kind not in REFERENCE_SUFFIXES:
        raise H3ClientError(f"a reference kind is image, video or audio (got {kind!r}).")
    return f"ref_{kind}", Path(path)


class H3ClientError(RuntimeError):
    """The server refused a call or a job did not succeed; `status` is the HTTP status (or None) and `detail` the
    server's explanation."""

    def __init__(self, message: str, status: int | None = None, detail=None):
        super().__init__(message)
        self.status = status
        self.detail = detail


class H3Client:
    """Create, follow, download and cancel generation jobs."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text
        if isinstance(detail, list):
            message = "; ".join(f"{'.'.join(map(str, d.get('loc', [])[1:]))}: {d.get('msg')}" for d in detail)
        else:
            message = str(detail)
        raise H3ClientError(f"HTTP {response.status_code}: {message}", response.status_code, detail)

    def health(self) -> dict:
        return self._check(self._http.get("/health")).json()

    def create(self, prompt: str, *, image=None, last_image=None, references=None, **fields) -> dict:
        """Queue a job (`task` defaults to fl2va when a keyframe is given, ref2va when `references` are: paths,
        kind by suffix, or `(kind, path)` pairs, in the order the model reads them). Returns the job's `Video`
        object (OpenAI's shape: `id`, `status` queued / in_progress / completed / failed, `progress`, ...)."""
        files = [(name, Path(path)) for name, path in (("image", image), ("last_image", last_image)) if path]
        files += [_reference_part(reference) for reference in references or ()]
        body = {"prompt": prompt, **{k: v for k, v in fields.items() if v is not None}}
        if files:
            body.setdefault("task", "ref2va" if references else "fl2va")
            handles = [(name, (path.name, path.open("rb"))) for name, path in files]
            try:
                # Form fields are text; an object (`cache`) or a list (`loras`, `prompts`) goes as its JSON.
                data = {k: json.dumps(v) if isinstance(v, (list, dict)) else str(v) for k, v in body.items()}
                response = self._http.post("/v1/videos", data=data, files=handles)
            finally:
                for _, (_, handle) in handles:
                    handle.close()
        else:
            response = self._http.post("/v1/videos", json=body)
        return self._check(response).json()

    def get(self, job_id: str) -> dict:
        return self._check(self._http.get(f"/v1/videos/{job_id}")).json()

    def list(self, limit: int = 20, after: str | None = None) -> dict:
        params = {"limit": limit, **({"after": after} if after else {})}
        return self._check(self._http.get("/v1/videos", params=params)).json()

    def cancel(self, job_id: str) -> dict:
        """Cancel a queued or running job, or delete a finished one: `{id, object: "video.deleted", deleted, video}`."""
        return self._check(self._http.delete(f"/v1/videos/{job_id}")).json()

    def wait(self, job_id: str, *, poll: float = 0.5, timeout: float | None = None, on_progress=None) -> dict:
        """Poll until the video is completed; `on_progress(view)` sees every poll. Raises on failure or cancel
        (a cancelled job is failed with `error.code` "cancelled")."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self.get(job_id)
            if on_progress:
                on_progress(view)
            if view["status"] == "completed":
                return view
            if view["status"] == "failed":
                error = view.get("error") or {}
                reason = "cancelled" if error.get("code") == "cancelled" else f"failed: {error.get('message', '')}"
                raise H3ClientError(f"job {job_id} {reason}".strip(), None, view)
            if deadline is not None and time.monotonic() > deadline:
                raise H3ClientError(f"job {job_id} still {view['status']} after {timeout} s", None, view)
            time.sleep(poll)

    def download(self, job_id: str, out) -> Path:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with self._http.stream("GET", f"/v1/videos/{job_id}/content") as response:
            if not response.is_success:
                response.read()
                self._check(response)
            partial = out.with_name(f".{out.name}.partial")
            with open(partial, "wb") as handle:
                for chunk in response.iter_bytes():
                    handle.write(chunk)
        partial.replace(out)
        return out

    def generate(self, prompt: str, *, out, timeout: float | None = None, on_progress=None, **fields) -> dict:
        """Create a job, wait for it and download the MP4 to `out`. Returns the finished job's view."""
        job = self.create(prompt, **fields)
        view = self.wait(job["id"], timeout=timeout, on_progress=on_progress)
        self.download(job["id"], out)
        return view
