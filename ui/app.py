"""The Gradio web UI, mounted at `/ui` on the API server. It submits to the same job manager as the REST API, so
a job started here shows up in `/v1/videos` and obeys the same queue, limits and validation."""

import shutil
import time
from pathlib import Path

import gradio as gr
from pydantic import ValidationError

from h3gen.errors import RequestError
from h3gen.options import TASKS
from h3gen.server.engine import upload_name
from h3gen.server.jobs import FINISHED, QueueFull
from h3gen.server.schemas import GenerationRequest

ASPECTS = ["auto", "16:9", "9:16", "1:1", "4:3", "3:4", "21:9", "4:1", "1:4"]
HISTORY_COLUMNS = ["id", "status", "prompt", "seconds", "seed"]
POLL_SECONDS = 0.25


def _history(manager) -> list[list]:
    jobs, _ = manager.list(limit=20)
    return [[job["id"], job["status"], job["request"].get("prompt", "")[:80], job["request"].get("duration"),
             job["request"].get("seed")] for job in jobs]


def _validation_message(error: ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    field = ".".join(str(part) for part in first["loc"]) or "request"
    return f"{field}: {first['msg']}"


def _reference_files(paths) -> dict[str, str]:
    """ref2va uploads keyed as the REST API keys them (`ref_<kind>_<position>`), the kind read off each file."""
    from h3gen.pipelines.h3.references import reference_kind

    files = {}
    for position, path in enumerate(paths or []):
        path = getattr(path, "name", path)  # Gradio hands file paths (or objects with .name)
        files[upload_name(f"ref_{reference_kind(path, 'references')}", position)] = path
    return files


def build_ui(manager) -> gr.Blocks:
    """The Blocks app: prompt, task, keyframes or references, aspect, seconds, seed (with randomize), steps, a
    progress bar fed by the job's progress, the result as a playable video with audio, and a history of results."""

    has_planner = getattr(manager.engine, "planner", None) is not None

    def generate(prompt, task, image, last_image, references, aspect, seconds, steps, seed, randomize, plan,
                 progress=gr.Progress()):
        images = {name: path for name, path in (("image", image), ("last_image", last_image)) if path}
        try:
            images.update(_reference_files(references))
        except RequestError as error:
            raise gr.Error(str(error)) from None
        fields = dict(prompt=prompt or "", task=task, seconds=float(seconds), num_inference_steps=int(steps),
                      aspect_ratio=None if aspect in (None, "auto") else aspect,
                      seed=None if randomize or seed is None else int(seed), plan=bool(plan))
        try:
            request = GenerationRequest.model_validate(fields)
        except ValidationError as error:
            raise gr.Error(_validation_message(error)) from None
        staging = manager.staging_dir()
        try:
            uploads = {}
            for name, path in images.items():  # Gradio's temporary copies may vanish; the job keeps its own
                uploads[name] = staging / f"{name}{Path(path).suffix}"
                shutil.copyfile(path, uploads[name])
            normalized = manager.engine.validate(request, uploads)
            job = manager.submit(normalized, uploads)
        except RequestError as error:
            raise gr.Error(f"{error.field}: {error}" if error.field else str(error)) from None
        except QueueFull as error:
            raise gr.Error(str(error)) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)

        job_id = job["id"]
        seed_used = normalized["seed"]
        while True:
            view = manager.get(job_id)
            if view is None:
                raise gr.Error("the job was deleted")
            stage = view["stage"] or view["status"]
            where = f", #{view['queue_position']} in queue" if view.get("queue_position") else ""
            progress(view["progress"] / 100.0, desc=f"{stage} {view['progress']:.0f}%")
            status = f"Job {job_id}: {view['status']}{where} — {stage}, {view['progress']:.0f}%"
            if view["status"] in FINISHED:
                break
            yield status, None, job_id, seed_used, gr.update(), view.get("planned_prompt") or ""
            time.sleep(POLL_SECONDS)
        if view["status"] == "failed":
            raise gr.Error(f"generation failed: {view['error']}")
        if view["status"] == "cancelled":
            yield (f"Job {job_id}: cancelled", None, job_id, seed_used, _history(manager),
                   view.get("planned_prompt") or "")
            return
        total = sum(view["timings"].values())
        yield (f"Job {job_id}: done in {total:.1f} s — {view['request']['width']}x{view['request']['height']}, "
               f"{view['request']['num_frames']} frames, seed {seed_used}", str(manager.result_path(job_id)), job_id,
               seed_used, _history(manager), view.get("planned_prompt") or "")

    def cancel(job_id):
        if not job_id:
            return "Nothing to cancel."
        view = manager.cancel(job_id)
        return f"Job {job_id}: {view['status'] if view else 'gone'}"

    def show(history, event: gr.SelectData):
        row = history.iloc[event.index[0]] if hasattr(history, "iloc") else history[event.index[0]]
        job_id = row[0] if not hasattr(row, "iloc") else row.iloc[0]
        path = manager.result_path(job_id)
        return (str(path) if path and path.exists() else None), f"Job {job_id}"

    with gr.Blocks(title="h3gen — MiniMax-H3", analytics_enabled=False) as demo:
        gr.Markdown("## h3gen — MiniMax-H3 video + stereo audio\nDescribe a clip; optionally give the first and/or "
                    "last frame (task fl2va), or reference images, videos and sounds (task ref2va).")
        job_state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt",
                                    placeholder="a red fox runs through fresh snow, wind howling")
                task = gr.Radio(list(TASKS), value=TASKS[0], label="Task", elem_id="task")
                with gr.Row():
                    image = gr.Image(type="filepath", label="First frame (fl2va)", elem_id="image")
                    last_image = gr.Image(type="filepath", label="Last frame (fl2va)", elem_id="last-image")
                references = gr.File(file_count="multiple", type="filepath", elem_id="references",
                                     file_types=["image", "video", "audio"],
                                     label="References (ref2va): up to 9 images, 3 videos, 3 sounds, in this order")
                with gr.Row():
                    aspect = gr.Dropdown(ASPECTS, value="auto", label="Aspect ratio", elem_id="aspect")
                    seconds = gr.Slider(5, 15, value=5, step=0.5, label="Seconds", elem_id="seconds")
                with gr.Row():
                    steps = gr.Slider(2, 100, value=50, step=1, label="Steps", elem_id="steps")
                    seed = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
                    randomize = gr.Checkbox(value=True, label="Random seed", elem_id="randomize")
                plan = gr.Checkbox(value=False, visible=has_planner, elem_id="plan",
                                   label="Plan the prompt with K3 first (picture, motion, camera, sound, music, "
                                         "dialogue)")
                with gr.Row():
                    run = gr.Button("Generate", variant="primary", elem_id="generate-btn")
                    stop = gr.Button("Cancel", elem_id="cancel-btn")
            with gr.Column(scale=1):
                status = gr.Textbox(label="Status", interactive=False, elem_id="status")
                planned = gr.Textbox(label="Planned prompt (what the clip is made from)", interactive=False, lines=4,
                                     visible=has_planner, elem_id="planned-prompt")
                video = gr.Video(label="Result", format="mp4", elem_id="result-video", autoplay=False)
                history = gr.Dataframe(headers=HISTORY_COLUMNS, value=lambda: _history(manager), interactive=False,
                                       label="History (click a row to play it)", elem_id="history")
        run.click(generate,
                  [prompt, task, image, last_image, references, aspect, seconds, steps, seed, randomize, plan],
                  [status, video, job_state, seed, history, planned], concurrency_limit=None)
        stop.click(cancel, [job_state], [status])
        history.select(show, [history], [video, status])
    return demo
