"""The prompt planner: a short user prompt (and optionally an image) -> an H3 prompt that describes the picture,
the motion and the sound of one clip.

Two backends with one method, `plan(prompt, image=None, max_tokens=None, seed=None, on_text=None, cancel=None)
-> PlannedPrompt` (`on_text(delta)` receives the text as it is written; a set `cancel` event stops it):
- `LocalPlanner`: a K3 model served by `K3Engine` in this process (continuous batching across concurrent calls,
  the system prompt stays in the prefix cache);
- `RemotePlanner`: any OpenAI-compatible `/chat/completions` endpoint (`base_url`, e.g. `http://host:8000/v1`).

`make_planner("tiny" | folder | "http(s)://...")` builds one. The tiny demo K3 has random weights, so its plans
are noise: planning is never on by default.
"""

import base64
import io
import json
import mimetypes
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from h3gen.errors import RequestError
from h3gen.media import check_pixels
from h3gen.pipelines.k3.demo_model import tiny_checkpoint
from h3gen.pipelines.k3.engine import K3Engine, SamplingParams
from h3gen.pipelines.k3.engine.request import FINISHED
from h3gen.pipelines.k3.image_processor import K3ImageProcessor
from h3gen.pipelines.k3.model import K3ForCausalLM
from h3gen.pipelines.k3.tokenizer import K3Tokenizer

SYSTEM_PROMPT = """\
You write prompts for a model that generates a short video together with its soundtrack (5 to 15 seconds, \
24 fps, stereo sound). Turn the user's idea (and image, if one is given: the video starts on it) into one \
prompt of 80 to 200 words, in the present tense, as one paragraph of plain prose, covering in this order:
1. Subjects and setting: who or what is in the picture, their look, the place, light, time of day, style.
2. Motion: what each subject does from start to end of the clip, in order.
3. Camera: shot size, angle, and how the camera moves (static, pan, dolly, handheld, ...).
4. Sound effects: the sounds the action makes and the ambience of the place.
5. Music: genre, instruments and mood, or "no music".
6. Dialogue: every spoken line in double quotes, with who says it and how; or "no dialogue".
Keep everything the user asked for; invent only what a director would have to decide. Reply with the prompt only: \
no title, no list, no explanation."""

DEFAULT_MAX_TOKENS = 512
MAX_PLAN_TOKENS = 4096


class PlannerError(RuntimeError):
    """The planner backend failed (unreachable, an error answer, no text). The message says which and why."""


@dataclass
class PlannedPrompt:
    prompt: str  # what the user wrote
    planned: str  # the H3 prompt
    backend: str  # "local:<model>" or "remote:<base_url>"
    tokens: int | None = None  # generated tokens, when the backend says
    seconds: float = 0.0


def _check(prompt: str, max_tokens: int | None) -> int:
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("the prompt to plan is empty.", "prompt")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_PLAN_TOKENS:
        raise RequestError(f"max_tokens must be between 1 and {MAX_PLAN_TOKENS} (got {max_tokens!r}).", "max_tokens")
    return max_tokens


def _finish(prompt: str, text: str, backend: str, tokens, started: float) -> PlannedPrompt:
    text = text.strip()
    if not text:
        raise PlannerError(f"the planner ({backend}) returned no text.")
    return PlannedPrompt(prompt, text, backend, tokens, round(time.perf_counter() - started, 4))


class LocalPlanner:
    """Plans with a K3 model in this process. Thread safe: concurrent `plan` calls are batched by the engine."""

    def __init__(
        self, engine, tokenizer, name: str = "k3", temperature: float = 0.6, top_p: float = 0.95, image_processor=None
    ):
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.image_processor = image_processor
        self.temperature, self.top_p = temperature, top_p
        self._lock = threading.Lock()
        self._stops = [tokenizer.special[t] for t in ("<|close|>", "<|end_of_msg|>") if t in tokenizer.special]

    @classmethod
    def from_pretrained(cls, folder, device=None, dtype=None, **engine_options) -> "LocalPlanner":
        """A K3 checkpoint folder (weights and tokenizer), or "tiny" for the random demo model."""
        name = str(folder)
        if name == "tiny":
            folder = tiny_checkpoint()
        folder = Path(folder)
        if not (folder / "config.json").exists():
            raise RequestError(
                f"{folder} is not a K3 checkpoint folder (no config.json); give a folder, 'tiny' or "
                "an http(s):// base URL.",
                "planner",
            )
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = K3ForCausalLM.from_pretrained(folder, torch_dtype=dtype, device=device)
        tokenizer = K3Tokenizer.from_folder(folder)
        engine_options.setdefault("max_context", 8192)
        engine_options.setdefault("max_batch", 8)
        image_processor = None
        if getattr(model, "vision_tower", None) is not None:
            image_processor = K3ImageProcessor.from_folder(folder)
        return cls(K3Engine(model, tokenizer, **engine_options), tokenizer, name=name, image_processor=image_processor)

    @property
    def backend(self) -> str:
        return f"local:{self.name}"

    @property
    def accepts_images(self) -> bool:
        return self.engine.accepts_images()

    def prompt_ids(self, prompt: str, images=None) -> list[int]:
        """The chat-template token ids; with `images` (a `ProcessedImages`) the image's placeholder is expanded to
        its media span."""
        content = [{"type": "text", "text": prompt}]
        if images is not None:
            content = [{"type": "image"}] + content
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, thinking=False)
        if images is not None:
            ids = self.tokenizer.expand_images(ids, images.num_tokens, images.image_sizes)
        return ids

    def process_image(self, image):
        """A path, bytes or image -> `ProcessedImages`, with a clear error for what cannot be read."""
        if isinstance(image, (str, Path)) and not Path(image).is_file():
            raise RequestError(f"image {Path(image).name} does not exist.", "image")
        try:
            if isinstance(image, (str, Path)):
                image = Image.open(image)
            elif isinstance(image, bytes):
                image = Image.open(io.BytesIO(image))
        except (OSError, UnidentifiedImageError, ValueError, TypeError) as error:
            raise RequestError(f"cannot read the image: {error}", "image") from None
        check_pixels(*image.size, "image")  # from the header, before a pixel is decoded
        try:
            return self.image_processor.preprocess(image)
        except (OSError, UnidentifiedImageError, ValueError, TypeError) as error:
            raise RequestError(f"cannot read the image: {error}", "image") from None

    def plan(
        self,
        prompt: str,
        image=None,
        max_tokens: int | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        on_text=None,
        cancel: threading.Event | None = None,
    ) -> PlannedPrompt:
        """Plan `prompt` (and `image`). `on_text(delta)` is called with each new piece of text as the engine writes
        it (the pieces add up to the raw text; the result's `planned` is it stripped). Setting `cancel` aborts the
        request and raises `PlannerError`."""
        max_tokens = _check(prompt, max_tokens)
        if image is not None and (not self.accepts_images or self.image_processor is None):
            raise RequestError(
                f"the planner model ({self.name}) has no vision tower, so it cannot read an image; plan without one.",
                "image",
            )
        started = time.perf_counter()
        params = SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            top_p=self.top_p,
            stop_token_ids=self._stops,
            temperature=self.temperature if temperature is None else temperature,
        )
        with self._lock:
            images = self.process_image(image) if image is not None else None
            request = self.engine.add_request(self.prompt_ids(prompt, images), params, images=images)
        shown = 0
        while True:  # whoever holds the lock steps the engine for every caller
            with self._lock:
                if cancel is not None and cancel.is_set():
                    self.engine.abort(request)
                    raise PlannerError("the planning was cancelled.")
                if request.status == FINISHED:
                    break
                self.engine.step()
                visible = request.text[: request.sent]  # the engine holds back a possible stop string's start
            if on_text is not None and len(visible) > shown:
                on_text(visible[shown:])
                shown = len(visible)
        if request.error:
            raise PlannerError(f"the planner failed: {request.error}")
        if on_text is not None and len(request.text) > shown:
            on_text(request.text[shown:])
        return _finish(prompt, request.text, self.backend, len(request.output_ids), started)


class RemotePlanner:
    """Plans through an OpenAI-compatible chat completions endpoint. `base_url` ends before `/chat/completions`."""

    def __init__(
        self,
        base_url: str,
        model: str = "k3",
        api_key: str | None = None,
        timeout: float = 120.0,
        temperature: float = 0.6,
        top_p: float = 0.95,
        accepts_images: bool = True,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise RequestError(
                f"the planner base URL must start with http:// or https:// (got {base_url!r}).", "planner"
            )
        self.base_url, self.model, self.api_key, self.timeout = base_url.rstrip("/"), model, api_key, timeout
        self.temperature, self.top_p = temperature, top_p
        self.accepts_images = accepts_images

    @property
    def backend(self) -> str:
        return f"remote:{self.base_url}"

    def body(self, prompt: str, image, max_tokens: int, seed, temperature) -> dict:
        content = prompt
        if image is not None:
            content = [{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": prompt}]
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "top_p": self.top_p,
            "temperature": self.temperature if temperature is None else temperature,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}],
        }
        if seed is not None:
            body["seed"] = seed
        return body

    def plan(
        self,
        prompt: str,
        image=None,
        max_tokens: int | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        on_text=None,
        cancel: threading.Event | None = None,
    ) -> PlannedPrompt:
        """Plan through the remote endpoint (one request, not streamed: `on_text` receives the whole text at once;
        `cancel` is checked before the request is sent)."""
        max_tokens = _check(prompt, max_tokens)
        if cancel is not None and cancel.is_set():
            raise PlannerError("the planning was cancelled.")
        started = time.perf_counter()
        data = json.dumps(self.body(prompt, image, max_tokens, seed, temperature)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = f"{self.base_url}/chat/completions"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=self.timeout) as reply:
                answer = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace")
            raise PlannerError(f"the planner at {url} answered HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            raise PlannerError(f"the planner at {url} is unreachable: {getattr(error, 'reason', error)}") from None
        except json.JSONDecodeError:
            raise PlannerError(f"the planner at {url} did not answer JSON.") from None
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise PlannerError(f"the planner at {url} answered without choices[0].message.content.") from None
        if not isinstance(text, str):
            raise PlannerError(f"the planner at {url} answered a non-text message.")
        tokens = (answer.get("usage") or {}).get("completion_tokens")
        result = _finish(prompt, text, self.backend, tokens, started)
        if on_text is not None:
            on_text(text)
        return result


def _data_url(image) -> str:
    """A `data:` URL of an image file path (or raw bytes, or a PIL image)."""
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise RequestError(f"image {path} does not exist.", "image")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        payload = path.read_bytes()
    elif isinstance(image, bytes):
        kind, payload = "application/octet-stream", image
    else:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        kind, payload = "image/png", buffer.getvalue()
    return f"data:{kind};base64,{base64.b64encode(payload).decode()}"


def make_planner(spec: str, device=None, dtype=None, api_key: str | None = None, model: str = "k3"):
    """ "tiny" (the random demo K3), a K3 checkpoint folder, or an OpenAI-compatible base URL."""
    if spec.startswith(("http://", "https://")):
        return RemotePlanner(spec, model=model, api_key=api_key)
    return LocalPlanner.from_pretrained(spec, device=device, dtype=dtype)
