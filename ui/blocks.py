"""The Gradio web UI, mounted at `/ui` on the API server. It submits to the same job manager as the REST API, so
a job started here shows up in `/v1/videos` and obeys the same queue, limits and validation."""

import html
import shutil
import time
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder
from pydantic import ValidationError

from h3gen.errors import RequestError
from h3gen.options import QUALITY_HELP, TASKS, RunOptions
from h3gen.pipelines.h3 import DEFAULT_OVERLAP_FRAMES, DEFAULT_WINDOW_FRAMES, MAX_SECONDS
from h3gen.pipelines.h3.tiny_checkpoint import TRANSFORMER as TINY_TRANSFORMER
from h3gen.server.job import FINISHED, JobStatus
from h3gen.server.jobs import QueueFull
from h3gen.server.openai_video import OPENAI_STATUS
from h3gen.server.schemas import MAX_PROMPT_CHARS, GenerationBody
from h3gen.ui.uploads import stage_uploads

ASPECTS = ["auto", "16:9", "9:16", "1:1", "4:3", "3:4", "21:9", "4:1", "1:4"]
HISTORY_COLUMNS = ["job", "status", "prompt", "seconds", "seed"]
LORA_COLUMNS = ["LoRA", "recipe", "scale"]
HISTORY_WIDTHS = ["13%", "17%", "32%", "14%", "24%"]
POLL_SECONDS = 0.25
# Job videos are served by the UI's own route, relative to the page at /ui/, one URL per job id (see mount.py).
MEDIA_ROUTE = "/media/{job_id}.mp4"
# Gradio's copies of uploads: swept every hour once a day old (a job keeps its own copy from the moment it is queued).
UPLOAD_CACHE = (3600, 86400)


def media_url(job_id: str) -> str:
    return MEDIA_ROUTE.format(job_id=job_id).lstrip("/")


def video_html(job_id: str | None) -> str:
    """The player for a job's MP4 (its sound included) and a download link; empty without a job."""
    if not job_id:
        return ""
    url = html.escape(media_url(job_id))
    return (
        f'<video src="{url}" controls playsinline preload="metadata" style="width:100%;max-height:480px">'
        f'</video><a href="{url}" download="{html.escape(job_id)}.mp4">Download MP4</a>'
    )


def progress_html(percent: float, label: str) -> str:
    """A progress bar (0-100) with its label."""
    percent = max(0.0, min(100.0, float(percent)))
    return (
        f'<div class="h3-progress"><progress value="{percent:.0f}" max="100" style="width:100%"></progress>'
        f"<span>{html.escape(label)}</span></div>"
    )


def serves_demo_model(engine) -> bool:
    """Whether the engine runs the tiny random-weight demo model (its transformer has the demo's shape)."""
    config = getattr(engine, "config", None)
    keys = ("hidden_size", "num_layers", "num_attention_heads", "attention_head_dim")
    return config is not None and all(getattr(config, key, None) == TINY_TRANSFORMER[key] for key in keys)


def status_label(status: str) -> str:
    """A job's status as the API names it (OpenAI's: queued, in_progress, completed, failed), except that a
    cancelled job says so."""
    return JobStatus.CANCELLED.value if status == JobStatus.CANCELLED else OPENAI_STATUS[status]


def long_clip_fields(window_prompts: str | None, window_frames, overlap_frames) -> dict:
    """The request fields of the long-clip inputs: one prompt per non-empty line, window and overlap when given."""
    lines = [line.strip() for line in (window_prompts or "").splitlines() if line.strip()]
    fields = {"prompts": lines} if lines else {}
    for name, value in (("window_frames", window_frames), ("overlap_frames", overlap_frames)):
        if value not in (None, ""):
            fields[name] = int(value)
    return fields


def _history(manager) -> list[list]:
    """The latest jobs as table rows: short id, status, prompt, seconds of video, seed."""
    jobs, _ = manager.list(limit=20)
    rows = []
    for job in jobs:
        request = job["request"] or {}
        seconds = request.get("duration") or request.get("seconds")
        rows.append(
            [
                job["id"][:8],
                status_label(job["status"]),
                (request.get("prompt") or "")[:80],
                f"{seconds:.1f}" if seconds else "",
                str(request.get("seed", "")),
            ]
        )
    return rows


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


class _Actions:
    """What the UI's buttons do, on the job manager; each answers with the outputs its event updates. Every problem
    is one message in Status; nothing is raised to Gradio (which would mark every output an error)."""

    def __init__(self, manager):
        self.manager = manager
        self.upload_folder = Path(get_upload_folder())

    def generate(
        self,
        prompt,
        task,
        image,
        last_image,
        references,
        aspect,
        seconds,
        steps,
        seed,
        randomize,
        plan,
        window_prompts="",
        window_frames=None,
        overlap_frames=None,
        quality=None,
        loras=None,
    ):
        idle = (gr.update(),) * 5  # video, job, seed, history, planned prompt stay as they are

        def problem(message):
            return (_problem(message), progress_html(0, ""), *idle)

        try:
            chosen = chosen_loras(loras)
        except RequestError as error:
            yield problem(str(error))
            return
        # Steps 0 is "auto": 50 sigma points, or the recipe of a few-step adapter.
        fields = dict(
            prompt=prompt or "",
            task=task,
            seconds=float(seconds),
            num_inference_steps=int(steps) if steps else None,
            aspect_ratio=None if aspect in (None, "auto") else aspect,
            seed=None if randomize or seed is None else int(seed),
            plan=bool(plan),
            quality=quality or None,
            loras=chosen or None,
            **long_clip_fields(window_prompts, window_frames, overlap_frames),
        )
        try:
            request = GenerationBody.model_validate(fields)
        except ValidationError as error:
            yield problem(_validation_message(error))
            return
        staging = self.manager.staging_dir()
        try:
            uploads = stage_uploads(image, last_image, references, staging, self.upload_folder)
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
                yield problem(f"Job {job_id[:8]} was deleted.")
                return
            stage_name = view["stage"] or status_label(view["status"])
            if view.get("window"):
                stage_name = f"window {view['window']}, {stage_name}"
            where = f", #{view['queue_position']} in queue" if view.get("queue_position") else ""
            percent = f"{view['progress']:.0f}%"
            status = f"Job {job_id[:8]}: {status_label(view['status'])}{where} — {stage_name}, {percent}"
            if view["status"] in FINISHED:
                break
            yield (
                status,
                progress_html(view["progress"], f"{stage_name} {view['progress']:.0f}%"),
                gr.update(),
                job_id,
                seed_used,
                gr.update(),
                view.get("planned_prompt") or "",
            )
            time.sleep(POLL_SECONDS)
        planned_prompt = view.get("planned_prompt") or ""
        if view["status"] != JobStatus.SUCCEEDED:
            message = (
                f"Job {job_id[:8]}: cancelled."
                if view["status"] == JobStatus.CANCELLED
                else f"Job {job_id[:8]} failed: {view['error']}"
            )
            yield (
                message,
                progress_html(0, status_label(view["status"])),
                gr.update(),
                job_id,
                seed_used,
                _history(self.manager),
                planned_prompt,
            )
            return
        total = sum(view["timings"].values())
        done = view["request"]
        applied = ", ".join(f"{lora['name']} x{lora['scale']:g}" for lora in done.get("loras") or [])
        cached = view.get("cached_steps")
        cached = "" if cached is None else f", {len(cached)} forwards cached"
        yield (
            f"Job {job_id[:8]}: done in {total:.1f} s — {done['width']}x{done['height']}, "
            f"{done['num_frames']} frames, seed {seed_used}, {done.get('forwards')} forwards{cached}"
            + (f", LoRA {applied}" if applied else ""),
            progress_html(100, "done"),
            video_html(job_id),
            job_id,
            seed_used,
            _history(self.manager),
            planned_prompt,
        )

    def cancel(self, job_id):
        if not job_id:
            return "Nothing to cancel.", gr.update(), gr.update()
        view = self.manager.cancel(job_id)
        if view is None:
            return f"Job {job_id[:8]} is gone.", "", _history(self.manager)
        if view.get("deleted"):
            return f"Job {job_id[:8]}: deleted, with its video.", "", _history(self.manager)
        return f"Job {job_id[:8]}: {status_label(view['status'])}.", gr.update(), _history(self.manager)

    def show(self, event: gr.SelectData):
        short = str(event.row_value[0]) if event.row_value else ""
        jobs, _ = self.manager.list(limit=20)
        job = next((job for job in jobs if short and job["id"].startswith(short)), None)
        if job is None:
            return "", f"Job {short} is gone.", None
        path = self.manager.result_path(job["id"])
        if job["status"] != JobStatus.SUCCEEDED or path is None or not path.exists():
            return "", f"Job {short}: {status_label(job['status'])}, no video to play.", job["id"]
        return video_html(job["id"]), f"Job {short}: playing its video.", job["id"]


def build_ui(manager) -> gr.Blocks:
    """The Blocks app: prompt, task, keyframes or references, aspect, seconds, seed (with randomize), steps, the
    LoRA picker (the server's --lora-dir, a scale each), a
    progress bar fed by the job's progress, the result as a playable video with audio, and a history of results
    (what the buttons do: `_Actions`)."""

    has_planner = getattr(manager.engine, "planner", None) is not None
    max_seconds = getattr(manager.engine, "max_seconds", MAX_SECONDS)
    has_loras = getattr(manager.engine, "lora_folder", None) is not None
    actions = _Actions(manager)

    with gr.Blocks(title="h3gen — MiniMax-H3", analytics_enabled=False, delete_cache=UPLOAD_CACHE) as demo:
        gr.Markdown(
            "## h3gen — MiniMax-H3 video + stereo audio\nDescribe a clip; optionally give the first and/or "
            "last frame (task fl2va), or reference images, videos and sounds (task ref2va)."
        )
        gr.Markdown(
            "**Demo model:** this server runs the tiny built-in model with random weights, so every picture "
            "and sound it makes is noise. Start `h3gen serve --model <checkpoint folder>` for real clips.",
            visible=serves_demo_model(manager.engine),
            elem_id="demo-model-note",
        )
        job_state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(
                    label="Prompt",
                    lines=3,
                    elem_id="prompt",
                    placeholder="a red fox runs through fresh snow, wind howling",
                )
                task = gr.Radio(list(TASKS), value=TASKS[0], label="Task", elem_id="task")
                with gr.Row():
                    # image_mode=None: Gradio hands the file over as uploaded instead of decoding it to convert
                    # its mode, so the pixel count is checked from the header before anything decodes it.
                    image = gr.Image(type="filepath", image_mode=None, label="First frame (fl2va)", elem_id="image")
                    last_image = gr.Image(
                        type="filepath", image_mode=None, label="Last frame (fl2va)", elem_id="last-image"
                    )
                references = gr.File(
                    file_count="multiple",
                    type="filepath",
                    elem_id="references",
                    file_types=["image", "video", "audio"],
                    label="References (ref2va): up to 9 images, 3 videos, 3 sounds, in this order",
                )
                with gr.Row():
                    aspect = gr.Dropdown(ASPECTS, value="auto", label="Aspect ratio", elem_id="aspect")
                    seconds = gr.Slider(
                        5,
                        max_seconds,
                        value=5,
                        step=0.5,
                        elem_id="seconds",
                        label=f"Seconds (over 15: made in overlapping windows; up to {max_seconds:g})",
                    )
                window_prompts = gr.Textbox(
                    label="Prompts per window (clips over 15 s): one line per window, or one "
                    "line for all; empty: the prompt above",
                    lines=2,
                    elem_id="window-prompts",
                )
                with gr.Accordion("Windows (clips over 15 s)", open=False):
                    with gr.Row():
                        window_frames = gr.Number(
                            value=DEFAULT_WINDOW_FRAMES,
                            precision=0,
                            elem_id="window-frames",
                            label="Frames per window (17n+5, 124 to 345)",
                        )
                        overlap_frames = gr.Number(
                            value=DEFAULT_OVERLAP_FRAMES,
                            precision=0,
                            elem_id="overlap-frames",
                            label="Overlap frames (17n+5, shorter than the window)",
                        )
                with gr.Row():
                    steps = gr.Slider(
                        0,
                        100,
                        value=0,
                        step=1,
                        elem_id="steps",
                        label="Steps: N sigma points = N − 1 forwards (0: 50, or the LoRA recipe's)",
                    )
                    seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
                    randomize = gr.Checkbox(value=True, label="Random seed", elem_id="randomize")
                qualities, default_quality = quality_choices(manager.engine)
                quality = gr.Dropdown(qualities, value=default_quality, label="Quality", elem_id="quality")
                loras = gr.Dataframe(
                    value=lambda: lora_rows(manager.engine),
                    headers=LORA_COLUMNS,
                    datatype=["str", "str", "number"],
                    type="array",
                    interactive=True,
                    static_columns=[0, 1],
                    visible=has_loras,
                    elem_id="loras",
                    label="LoRA adapters (--lora-dir): set a scale to apply one; 0 leaves it out",
                )
                plan = gr.Checkbox(
                    value=False,
                    visible=has_planner,
                    elem_id="plan",
                    label="Plan the prompt with K3 first (picture, motion, camera, sound, music, dialogue)",
                )
                with gr.Row():
                    run = gr.Button("Generate", variant="primary", elem_id="generate-btn")
                    stop = gr.Button("Cancel", elem_id="cancel-btn")
            with gr.Column(scale=1):
                status = gr.Textbox(label="Status", interactive=False, elem_id="status")
                progress = gr.HTML(progress_html(0, "idle"), elem_id="progress")
                planned = gr.Textbox(
                    label="Planned prompt (what the clip is made from)",
                    interactive=False,
                    lines=4,
                    visible=has_planner,
                    elem_id="planned-prompt",
                )
                video = gr.HTML("", label="Result", elem_id="result-video")
                history = gr.Dataframe(
                    headers=HISTORY_COLUMNS,
                    value=lambda: _history(manager),
                    interactive=False,
                    column_widths=HISTORY_WIDTHS,
                    wrap=True,
                    label="History (click a row to play it)",
                    elem_id="history",
                )
        # A click while the last Generate still follows its job (a cancelled job's, until its next poll) runs once
        # that one ends, never dropped.
        run.click(
            actions.generate,
            [
                prompt,
                task,
                image,
                last_image,
                references,
                aspect,
                seconds,
                steps,
                seed,
                randomize,
                plan,
                window_prompts,
                window_frames,
                overlap_frames,
                quality,
                loras,
            ],
            [status, progress, video, job_state, seed, history, planned],
            concurrency_limit=None,
            show_progress="hidden",
            trigger_mode="always_last",
        )
        stop.click(actions.cancel, [job_state], [status, video, history], show_progress="hidden")
        history.select(actions.show, None, [video, status, job_state], show_progress="hidden")
    return demo
