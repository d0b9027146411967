"""What the web UI's controls do, on the job manager, and the request fields its inputs make. Every action answers
with the outputs its event updates; every problem is one message in Status, nothing is raised to Gradio (which would
mark every output an error)."""

import inspect
import shutil
import time
from dataclasses import dataclass, fields
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder
from pydantic import ValidationError

from h3gen.errors import RequestError
from h3gen.options import QUALITY_HELP, RunOptions
from h3gen.pipelines.h3.tiny_checkpoint import TRANSFORMER as TINY_TRANSFORMER
from h3gen.server.job import FINISHED, JobStatus
from h3gen.server.jobs import QueueFull
from h3gen.server.schemas import MAX_PROMPT_CHARS, GenerationBody
from h3gen.ui.uploads import stage_uploads
from h3gen.ui.views import (
    history_page,
    preview_html,
    progress_html,
    stage_text,
    status_label,
    status_line,
    video_html,
    why,
)

POLL_SECONDS = 0.25
LONG_CLIP_SECONDS = 15  # past this length a clip is made in windows: the per-window inputs show and count


@dataclass(frozen=True)
class GenerateForm:
    """The Generate button's inputs, in the order the page hands them to `Actions.generate` (`build_ui` lists its
    components by these names: `GENERATE_INPUTS`). Values are as Gradio hands them over: an empty number is None,
    an upload is a file path."""

    prompt: str | None
    task: str
    image: str | None  # fl2va's first frame
    last_image: str | None  # fl2va's last frame
    references: list[str] | None  # ref2va's pictures, videos and sounds
    aspect: str | None  # "auto" or a ratio such as "16:9"
    seconds: float
    steps: float | None  # 0: 50 sigma points, or the recipe's
    seed: float | None
    randomize: bool
    plan: bool
    window_prompts: str | None = ""  # one prompt per line; the window inputs count past LONG_CLIP_SECONDS only
    window_frames: float | None = None
    overlap_frames: float | None = None
    quality: str | None = None
    loras: list | None = None  # the picker's rows: name, recipe, scale
    preview_every: float | None = None
    sparsity: str | None = ""  # see `sparsity_of_text`
    dense_forwards: float | None = None


GENERATE_INPUTS = tuple(field.name for field in fields(GenerateForm))


def serves_demo_model(engine) -> bool:
    """Whether the engine runs the tiny random-weight demo model (its transformer has the demo's shape)."""
    config = getattr(engine, "config", None)
    keys = ("hidden_size", "num_layers", "num_attention_heads", "attention_head_dim")
    return config is not None and all(getattr(config, key, None) == TINY_TRANSFORMER[key] for key in keys)


def long_clip_fields(window_prompts: str | None, window_frames, overlap_frames) -> dict:
    """The request fields of the long-clip inputs: one prompt per non-empty line, window and overlap when given."""
    lines = [line.strip() for line in (window_prompts or "").splitlines() if line.strip()]
    fields = {"prompts": lines} if lines else {}
    for name, value in (("window_frames", window_frames), ("overlap_frames", overlap_frames)):
        if value not in (None, ""):
            fields[name] = int(value)
    return fields


def quality_choices(engine) -> tuple[list[tuple[str, str]], str]:
    """The quality tiers this server serves, each labelled with its help (`QUALITY_HELP`), and its default."""
    options = getattr(engine, "options", None)
    options = options if isinstance(options, RunOptions) else RunOptions()
    return [(f"{tier}: {QUALITY_HELP[tier]}", tier) for tier in options.servable_tiers()], options.quality


def lora_rows(engine) -> list[list]:
    """The picker's rows: every adapter of the server's LoRA folder (`--lora-dir`) with its recipe and scale 0
    (not applied until a scale is set)."""
    folder = getattr(engine, "lora_folder", None)
    if folder is None:
        return []
    rows = []
    for entry in folder.listing():
        recipe = entry.get("recipe") or {}
        what = (
            f"{recipe['name']}: {recipe['forwards']} forwards" if recipe else ("unusable" if entry.get("error") else "")
        )
        rows.append([entry["name"], what, 0.0])
    return rows


def chosen_loras(rows) -> list[dict]:
    """The picker's rows with a scale other than 0, as the request's `loras`."""
    chosen = []
    for row in rows or []:
        name, scale = row[0], row[-1]
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise RequestError(f"the scale of LoRA {name} must be a number (got {scale!r}).", "loras") from None
        if name and scale != 0:
            chosen.append({"name": str(name), "scale": scale})
    return chosen


def _validation_message(error: ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    field = ".".join(str(part) for part in first["loc"]) or "request"
    if field == "prompt" and first["type"] == "string_too_short":
        return f"Write a prompt first: describe the clip you want (1 to {MAX_PROMPT_CHARS} characters)."
    return f"{field}: {first['msg']}"


def _problem(message: str) -> str:
    return f"⚠ {message}"


def sparsity_of_text(text) -> float | list[float] | str | None:
    """The Advanced group's sparse-attention field: empty -> None (the model's own), "default", one number, or
    comma-separated numbers (one per forward). The range is checked with the request; text that is none of these
    raises `RequestError`."""
    text = (text or "").strip()
    if not text:
        return None
    if text == "default":
        return "default"
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise RequestError(
            f'sparsity must be a number from 0 up to 1, comma-separated numbers or "default" (got {text[:40]!r}).',
            "sparsity",
        ) from None
    return values[0] if len(values) == 1 else values


class Actions:
    """The UI's events on `manager` (a `JobManager`)."""

    def __init__(self, manager):
        self.manager = manager
        self.upload_folder = Path(get_upload_folder())

    def _request(self, form: GenerateForm) -> GenerationBody:
        long = {}
        if float(form.seconds) > LONG_CLIP_SECONDS:
            long = long_clip_fields(form.window_prompts, form.window_frames, form.overlap_frames)
        # Steps 0 is "auto": 50 sigma points, or the recipe of a few-step adapter.
        values = dict(
            prompt=form.prompt or "",
            task=form.task,
            seconds=float(form.seconds),
            num_inference_steps=int(form.steps) if form.steps else None,
            aspect_ratio=None if form.aspect in (None, "auto") else form.aspect,
            seed=None if form.randomize or form.seed is None else int(form.seed),
            plan=bool(form.plan),
            quality=form.quality or None,
            loras=chosen_loras(form.loras) or None,
            preview_every=None if form.preview_every in (None, "") else int(form.preview_every),
            sparsity=sparsity_of_text(form.sparsity),
            dense_forwards=None if form.dense_forwards in (None, "") else int(form.dense_forwards),
            **long,
        )
        return GenerationBody.model_validate(values)

    def generate(self, *values):
        """Validate and queue a job from the Generate button's inputs (`values`, in `GenerateForm`'s order), then
        follow it: (status, progress bar, preview, player, job id, seed, planned prompt) as it runs, every
        `POLL_SECONDS`."""
        idle = (gr.update(),) * 4  # player, job, seed, planned prompt stay as they are

        def problem(message):
            return (_problem(message), progress_html(0, ""), "", *idle)

        form = GenerateForm(*values)
        try:
            request = self._request(form)
        except RequestError as error:
            yield problem(str(error))
            return
        except ValidationError as error:
            yield problem(_validation_message(error))
            return
        staging = self.manager.staging_dir()
        try:
            uploads = stage_uploads(
                form.image if form.task == "fl2va" else None,
                form.last_image if form.task == "fl2va" else None,
                form.references if form.task == "ref2va" else None,
                staging,
                self.upload_folder,
            )
            normalized = self.manager.engine.validate(request, uploads)
            job = self.manager.submit(normalized, uploads)
        except RequestError as error:
            message = str(error).replace(f"{staging}/", "")  # name the field's file, never a server folder
            yield problem(
                message if not error.field or message.startswith(error.field) else f"{error.field}: {message}"
            )
            return
        except QueueFull as error:
            yield problem(str(error))
            return
        finally:
            shutil.rmtree(staging, ignore_errors=True)

        job_id = job["id"]
        seed_used = normalized["seed"]
        while True:
            view = self.manager.get(job_id)
            if view is None:
                yield problem(f"Job {job_id} was deleted.")
                return
            if view["status"] in FINISHED:
                break
            yield (
                status_line(view),
                progress_html(view["progress"], f"{stage_text(view)} {view['progress']:.0f}%"),
                preview_html(view) or gr.update(),
                gr.update(),
                job_id,
                seed_used,
                view.get("planned_prompt") or "",
            )
            time.sleep(POLL_SECONDS)
        planned_prompt = view.get("planned_prompt") or ""
        if view["status"] != JobStatus.SUCCEEDED:
            message = (
                f"Job {job_id}: cancelled."
                if view["status"] == JobStatus.CANCELLED
                else f"Job {job_id} failed: {view['error']}"
            )
            yield (
                message,
                progress_html(0, status_label(view["status"])),
                "",
                gr.update(),
                job_id,
                seed_used,
                planned_prompt,
            )
            return
        yield (
            done_line(view),
            progress_html(100, "done"),
            "",
            video_html(job_id),
            job_id,
            seed_used,
            planned_prompt,
        )

    # Gradio names the endpoint's parameters and their defaults from the signature: the form's fields.
    generate.__signature__ = inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *inspect.signature(GenerateForm).parameters.values(),
        ]
    )

    def cancel(self, job_id):
        """Cancel the job shown (a finished one is deleted with its video): (status, player)."""
        if not job_id:
            return "Nothing to cancel.", gr.update()
        view = self.manager.cancel(job_id)
        if view is None:
            return f"Job {job_id} is gone.", ""
        if view.get("deleted"):
            return f"Job {job_id}: deleted, with its video.", ""
        return f"Job {job_id}: {status_label(view['status'])}.", gr.update()

    def show(self, event: gr.SelectData):
        """A click on a history row: play its clip, or say why there is none: (player, status, job id)."""
        job_id = str(event.row_value[0]) if event.row_value else ""
        view = self.manager.get(job_id) if job_id else None
        if view is None:
            return "", f"Job {job_id} is gone.", None
        path = self.manager.result_path(job_id)
        if view["status"] != JobStatus.SUCCEEDED or path is None or not path.exists():
            state = why(view) or status_label(view["status"])
            return "", f"Job {job_id}: {state}; no video to play.", job_id
        return video_html(job_id), f"Job {job_id}: playing its video.", job_id

    def history(self, pages):
        """The history's page after the cursors `pages`: (pages, rows, label, older button, newer button)."""
        pages = pages or [None]
        rows, has_more, label = history_page(self.manager, pages)
        return pages, rows, label, gr.update(interactive=has_more), gr.update(interactive=len(pages) > 1)

    def older(self, pages):
        pages = pages or [None]
        rows, has_more, _ = history_page(self.manager, pages)
        return self.history(pages + [rows[-1][0]] if has_more and rows else pages)

    def newer(self, pages):
        return self.history((pages or [None])[:-1] or [None])


def done_line(view: dict) -> str:
    """The status of a job that succeeded: time, canvas, frames, seed, forwards, cached forwards, adapters."""
    total = sum(view["timings"].values())
    done = view["request"]
    applied = ", ".join(f"{lora['name']} x{lora['scale']:g}" for lora in done.get("loras") or [])
    cached = view.get("cached_steps")
    cached = "" if cached is None else f", {len(cached)} forwards cached"
    windows = f" in {done['windows']} windows" if done.get("windows") else ""
    forwards = f"{done.get('forwards')} forwards" + (" per window" if windows else "")
    return (
        f"Job {view['id']}: done in {total:.1f} s — {done['width']}x{done['height']}, {done['num_frames']} frames"
        f"{windows}, seed {done['seed']}, {forwards}{cached}"
        + (f", recipe {done['recipe']}" if done.get("recipe") else "")
        + (f", LoRA {applied}" if applied else "")
    )
