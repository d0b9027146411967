"""The Gradio web UI, mounted at `/ui` on the API server. It submits to the same job manager as the REST API, so
a job started here shows up in `/v1/videos` and obeys the same queue, limits and validation.

The page follows the work: the prompt, the task, the length and Generate / Cancel at the top (in view at 1366x768);
below them only the chosen task's inputs (keyframes for fl2va, references for ref2va, the per-window prompts once
the length passes 15 s), the LoRA picker where the server has adapters, and the sampling and quality settings in a
collapsed Advanced group. Beside them the job: status (stage, progress, elapsed time, time left), the progress bar,
the latest preview under it, then the clip. The history under both pages through every job and follows them."""

import gradio as gr

from h3gen.options import TASKS
from h3gen.pipelines.h3 import DEFAULT_OVERLAP_FRAMES, DEFAULT_WINDOW_FRAMES, MAX_SECONDS
from h3gen.ui.actions import (
    GENERATE_INPUTS,
    LONG_CLIP_SECONDS,
    Actions,
    lora_rows,
    quality_choices,
    serves_demo_model,
)
from h3gen.ui.views import HISTORY_COLUMNS, progress_html, recipe_note

ASPECTS = ["auto", "16:9", "9:16", "1:1", "4:3", "3:4", "21:9", "4:1", "1:4"]
LORA_COLUMNS = ["LoRA", "recipe", "scale"]
TASK_LABELS = {"t2va": "text", "fl2va": "keyframes", "ref2va": "references"}
HISTORY_WIDTHS = ["24%", "9%", "27%", "7%", "13%", "20%"]
HISTORY_REFRESH_SECONDS = 2.0  # how often the history's rows follow their jobs
# Gradio's copies of uploads: swept every hour once a day old (a job keeps its own copy from the moment it is queued).
UPLOAD_CACHE = (3600, 86400)
# Ids whole on one line (monospace, never broken mid-id); a compact header; the preview sized to the column.
CSS = """
#history td:first-child, #history td:first-child * { font-family: ui-monospace, monospace; white-space: nowrap; }
#title h2 { margin: 0; }
#demo-model-note p { margin: 0; font-size: 0.9em; }
.h3-preview { margin: 0; }
.h3-preview figcaption { font-size: 0.85em; opacity: 0.8; }
"""


def task_inputs(task: str):
    """Which task inputs show: (keyframes group, references)."""
    return gr.update(visible=task == "fl2va"), gr.update(visible=task == "ref2va")


def window_inputs(seconds) -> dict:
    """The per-window inputs show once the length passes 15 s."""
    return gr.update(visible=float(seconds or 0) > LONG_CLIP_SECONDS)


def build_ui(manager) -> gr.Blocks:
    """The Blocks app (see the module); what the controls do is `Actions`."""

    engine = manager.engine
    has_planner = getattr(engine, "planner", None) is not None
    max_seconds = getattr(engine, "max_seconds", MAX_SECONDS)
    folder = getattr(engine, "lora_folder", None)
    actions = Actions(manager)

    with gr.Blocks(title="h3gen — MiniMax-H3", analytics_enabled=False, delete_cache=UPLOAD_CACHE) as demo:
        gr.Markdown("## h3gen — MiniMax-H3 video + stereo audio", elem_id="title")
        gr.Markdown(
            "**Demo model:** this server runs the tiny built-in model with random weights, so every picture "
            "and sound it makes is noise. Start `h3gen serve --model <checkpoint folder>` for real clips.",
            visible=serves_demo_model(engine),
            elem_id="demo-model-note",
        )
        form = {}  # the Generate button's inputs by name (`GENERATE_INPUTS`)
        job_state = gr.State(None)
        pages = gr.State([None])  # the history's page cursors (`after` ids), None for the first page
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                form["prompt"] = gr.Textbox(
                    label="Prompt",
                    lines=3,
                    elem_id="prompt",
                    placeholder="a red fox runs through fresh snow, wind howling",
                )
                with gr.Row():
                    task = form["task"] = gr.Radio(
                        [(f"{name}: {TASK_LABELS.get(name, name)}", name) for name in TASKS],
                        value=TASKS[0],
                        label="Task",
                        elem_id="task",
                        scale=3,
                    )
                    seconds = form["seconds"] = gr.Slider(
                        5,
                        max_seconds,
                        value=5,
                        step=0.5,
                        elem_id="seconds",
                        label=f"Seconds (5 to {max_seconds:g}; over {LONG_CLIP_SECONDS}: in windows)",
                        scale=2,
                    )
                    form["aspect"] = gr.Dropdown(ASPECTS, value="auto", label="Aspect ratio", elem_id="aspect", scale=1)
                with gr.Row():
                    run = gr.Button("Generate", variant="primary", elem_id="generate-btn", scale=3)
                    stop = gr.Button("Cancel", elem_id="cancel-btn", scale=1)
                with gr.Group(visible=False, elem_id="keyframes") as keyframes:
                    with gr.Row():
                        # image_mode=None: Gradio hands the file over as uploaded instead of decoding it to convert
                        # its mode, so the pixel count is checked from the header before anything decodes it.
                        form["image"] = gr.Image(
                            type="filepath", image_mode=None, label="First frame (fl2va)", elem_id="image", height=200
                        )
                        form["last_image"] = gr.Image(
                            type="filepath",
                            image_mode=None,
                            label="Last frame (fl2va)",
                            elem_id="last-image",
                            height=200,
                        )
                references = form["references"] = gr.File(
                    file_count="multiple",
                    type="filepath",
                    elem_id="references",
                    file_types=["image", "video", "audio"],
                    visible=False,
                    label="References (ref2va): up to 9 images, 3 videos, 3 sounds, in this order",
                )
                with gr.Group(visible=False, elem_id="windows") as windows:
                    form["window_prompts"] = gr.Textbox(
                        label="Prompts per window: one line per window, or one line for all; empty: the prompt above",
                        lines=2,
                        elem_id="window-prompts",
                    )
                    with gr.Row():
                        form["window_frames"] = gr.Number(
                            value=DEFAULT_WINDOW_FRAMES,
                            precision=0,
                            elem_id="window-frames",
                            label="Frames per window (17n+5, 124 to 345)",
                        )
                        form["overlap_frames"] = gr.Number(
                            value=DEFAULT_OVERLAP_FRAMES,
                            precision=0,
                            elem_id="overlap-frames",
                            label="Overlap frames (17n+5, shorter than the window)",
                        )
                loras = form["loras"] = gr.Dataframe(
                    value=lambda: lora_rows(engine),
                    headers=LORA_COLUMNS,
                    datatype=["str", "str", "number"],
                    type="array",
                    interactive=True,
                    static_columns=[0, 1],
                    visible=folder is not None,
                    elem_id="loras",
                    label="LoRA adapters (--lora-dir): set a scale to apply one; 0 leaves it out",
                )
                form["plan"] = gr.Checkbox(
                    value=False,
                    visible=has_planner,
                    elem_id="plan",
                    label="Plan the prompt with K3 first (picture, motion, camera, sound, music, dialogue)",
                )
                with gr.Accordion("Advanced: sampling and quality", open=False, elem_id="advanced"):
                    recipe = gr.Markdown("", elem_id="recipe-note")
                    with gr.Row():
                        form["steps"] = gr.Slider(
                            0,
                            100,
                            value=0,
                            step=1,
                            elem_id="steps",
                            label="Steps: N sigma points, N − 1 forwards (0: 50, or the recipe's)",
                        )
                        seed = form["seed"] = gr.Number(value=0, precision=0, minimum=0, label="Seed", elem_id="seed")
                        form["randomize"] = gr.Checkbox(value=True, label="Random seed", elem_id="randomize")
                    qualities, default_quality = quality_choices(engine)
                    with gr.Row():
                        form["quality"] = gr.Dropdown(
                            qualities, value=default_quality, label="Quality", elem_id="quality"
                        )
                        form["preview_every"] = gr.Number(
                            value=None,
                            precision=0,
                            minimum=0,
                            maximum=999,
                            elem_id="preview-every",
                            label="Preview every N forwards (empty: about a tenth of them; 0: no previews)",
                        )
                    with gr.Row():
                        form["sparsity"] = gr.Textbox(
                            value="",
                            elem_id="sparsity",
                            label="Sparse attention: video tiles dropped, 0 to 0.99, one per forward comma-separated, "
                            "or default (empty: the model's own)",
                        )
                        form["dense_forwards"] = gr.Number(
                            value=None, precision=0, minimum=0, elem_id="dense-forwards", label="First forwards dense"
                        )
            with gr.Column(scale=2):
                status = gr.Textbox(label="Status", interactive=False, elem_id="status", lines=2)
                progress = gr.HTML(progress_html(0, "idle"), elem_id="progress")
                preview = gr.HTML("", elem_id="preview")
                planned = gr.Textbox(
                    label="Planned prompt (what the clip is made from)",
                    interactive=False,
                    lines=4,
                    visible=has_planner,
                    elem_id="planned-prompt",
                )
                video = gr.HTML("", label="Result", elem_id="result-video")
        with gr.Row(equal_height=True):
            page_label = gr.Markdown("", elem_id="history-page")
            newer = gr.Button("‹ Newer", size="sm", interactive=False, elem_id="history-newer", scale=0)
            older = gr.Button("Older ›", size="sm", interactive=False, elem_id="history-older", scale=0)
        history = gr.Dataframe(
            headers=HISTORY_COLUMNS,
            interactive=False,
            column_widths=HISTORY_WIDTHS,
            wrap=True,
            label="History (click a row to play its clip)",
            elem_id="history",
        )
        timer = gr.Timer(HISTORY_REFRESH_SECONDS)

        task.change(task_inputs, task, [keyframes, references], show_progress="hidden")
        seconds.change(window_inputs, seconds, windows, show_progress="hidden")
        if folder is not None:
            loras.change(lambda rows: recipe_note(rows, folder.listing()), loras, recipe, show_progress="hidden")
        # A click while the last Generate still follows its job (a cancelled job's, until its next poll) runs once
        # that one ends, never dropped.
        run.click(
            actions.generate,
            [form[name] for name in GENERATE_INPUTS],
            [status, progress, preview, video, job_state, seed, planned],
            concurrency_limit=None,
            show_progress="hidden",
            trigger_mode="always_last",
        )
        stop.click(actions.cancel, [job_state], [status, video], show_progress="hidden")
        paging = [pages, history, page_label, older, newer]
        history.select(actions.show, None, [video, status, job_state], show_progress="hidden")
        older.click(actions.older, pages, paging, show_progress="hidden")
        newer.click(actions.newer, pages, paging, show_progress="hidden")
        timer.tick(actions.history, pages, paging, show_progress="hidden")
        demo.load(actions.history, pages, paging, show_progress="hidden")
    return demo
