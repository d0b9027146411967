"""What the web UI shows of a job, as text and HTML: its status line (stage, progress, elapsed time, time left), its
progress bar, its latest preview, its player, the history's rows and pages, and an adapter's recipe. Pure functions
of the job manager's views (`JobManager.view`), so each can be checked without a browser."""

import html
import time

from h3gen.server.job import JobStatus
from h3gen.server.openai_video import OPENAI_STATUS

# Job videos and previews are served by the UI's own routes, relative to the page at /ui/, one URL per job id (see
# mount.py).
MEDIA_ROUTE = "/media/{job_id}.mp4"
PREVIEW_ROUTE = "/media/{job_id}.jpg"
HISTORY_COLUMNS = ["job", "status", "prompt", "seconds", "seed", "why"]
HISTORY_PAGE = 10  # rows per page of the history


def media_url(job_id: str) -> str:
    return MEDIA_ROUTE.format(job_id=job_id).lstrip("/")


def preview_url(job_id: str, made_at: float) -> str:
    """The preview's URL; `made_at` makes each new preview a new URL, so the browser fetches it."""
    return PREVIEW_ROUTE.format(job_id=job_id).lstrip("/") + f"?at={made_at:.3f}"


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


def preview_html(view: dict | None) -> str:
    """The running job's latest preview with what it shows (forward k of n, the window of a long clip); empty when
    it has none."""
    preview = (view or {}).get("preview")
    if not preview or view.get("status") != JobStatus.RUNNING:
        return ""
    where = f"forward {preview['forward']} of {preview['forwards']}"
    if preview.get("window"):
        where += f", window {preview['window']}"
    url = html.escape(preview_url(view["id"], view["preview_at"]))
    return (
        f'<figure class="h3-preview"><img src="{url}" alt="preview after {where}" '
        f'style="width:100%;max-width:480px;height:auto;display:block">'
        f"<figcaption>Preview: the clip as it will come out, after {where}</figcaption></figure>"
    )


def clock(seconds: float) -> str:
    """Seconds as m:ss (h:mm:ss past an hour)."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def status_label(status: str) -> str:
    """A job's status as the API names it (OpenAI's: queued, in_progress, completed, failed), except that a
    cancelled job says so."""
    return JobStatus.CANCELLED.value if status == JobStatus.CANCELLED else OPENAI_STATUS[status]


def stage_text(view: dict) -> str:
    """The stage a job is in ("window 2/3, denoise"), or its status when no stage runs."""
    stage = view.get("stage") or status_label(view["status"])
    return f"window {view['window']}, {stage}" if view.get("window") else stage


def status_line(view: dict, now: float | None = None) -> str:
    """A running or queued job's status: its place in the queue, stage, progress, time since it started and the time
    left (from its measured forwards)."""
    now = time.time() if now is None else now
    where = f", #{view['queue_position']} in queue" if view.get("queue_position") else ""
    line = f"Job {view['id']}: {status_label(view['status'])}{where} — {stage_text(view)}, {view['progress']:.0f}%"
    if view.get("started_at"):
        line += f" · {clock(now - view['started_at'])} elapsed"
        eta = view.get("eta_seconds")
        line += f" · about {clock(eta)} left" if eta is not None else " · time left: measuring"
    return line


def why(view: dict) -> str:
    """What the history says of a job that did not succeed: the failure's reason, or where a cancelled job stopped."""
    if view["status"] == JobStatus.FAILED:
        return f"failed: {view.get('error') or 'no reason recorded'}"
    if view["status"] == JobStatus.CANCELLED:
        stage = (view.get("timings") or {}) and list(view["timings"])[-1]
        at = f" during {stage}" if stage else " while queued"
        return f"cancelled{at} at {view.get('progress') or 0:.0f}%"
    return ""


def history_rows(jobs: list[dict]) -> list[list]:
    """Table rows of job views: the whole id, status, prompt, seconds of video, seed and why it did not succeed."""
    rows = []
    for job in jobs:
        request = job["request"] or {}
        seconds = request.get("duration") or request.get("seconds")
        rows.append(
            [
                job["id"],
                status_label(job["status"]),
                (request.get("prompt") or "")[:80],
                f"{seconds:.1f}" if seconds else "",
                str(request.get("seed", "")),
                why(job)[:160],
            ]
        )
    return rows


def history_page(manager, pages: list[str | None]) -> tuple[list[list], bool, str]:
    """The history page that starts after the last of `pages` (the `after` cursor of each page shown so far, None
    for the first): its rows, whether an older page follows, and its label."""
    jobs, has_more = manager.list(limit=HISTORY_PAGE, after=pages[-1])
    first = (len(pages) - 1) * HISTORY_PAGE
    label = f"Jobs {first + 1}-{first + len(jobs)}" if jobs else "No jobs yet" if len(pages) == 1 else "No more jobs"
    return history_rows(jobs), has_more, label


def recipe_note(rows, listing: list[dict]) -> str:
    """What the Advanced group says of the chosen adapters' recipes (a few-step adapter brings its forwards and
    shifts): empty when none of the chosen ones brings one."""
    chosen = {str(row[0]) for row in rows or [] if row and row[-1] not in (None, "", 0, 0.0, "0")}
    notes = []
    for entry in listing:
        recipe = entry.get("recipe")
        if entry["name"] in chosen and recipe:
            notes.append(
                f"**{html.escape(entry['name'])}** brings its recipe *{html.escape(recipe['name'])}*: "
                f"{recipe['forwards']} forwards ({recipe['num_inference_steps']} sigma points), shifts "
                f"{recipe['video_shift']:g}/{recipe['audio_shift']:g}. Steps 0 follows it."
            )
    return "\n\n".join(notes)
