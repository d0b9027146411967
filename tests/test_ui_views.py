"""What the web UI shows of a job, without a browser (`ui/views.py`): the status line with elapsed time and time left,
the preview, why a job did not succeed, the history's pages and an adapter's recipe."""

from types import SimpleNamespace

from h3gen.ui.views import clock, history_page, preview_html, recipe_note, status_line, why

JOB = "0123456789abcdef0123456789abcdef"


def view(**changes) -> dict:
    base = dict(
        id=JOB,
        status="running",
        progress=42.4,
        stage="denoise",
        started_at=1000.0,
        eta_seconds=75.2,
        timings={"encode_text": 0.1, "denoise": 3.0},
        request={"prompt": "a fox", "duration": 5.1667, "seed": 3},
        error=None,
    )
    return base | changes


def test_status_line_names_stage_progress_elapsed_and_time_left():
    assert status_line(view(), now=1062.0) == (
        f"Job {JOB}: in_progress — denoise, 42% · 1:02 elapsed · about 1:15 left"
    )
    assert "window 2/3, denoise" in status_line(view(window="2/3"), now=1001.0)
    assert status_line(view(eta_seconds=None), now=1001.0).endswith("time left: measuring")
    queued = status_line(view(status="queued", stage=None, started_at=None, queue_position=2), now=1001.0)
    assert queued == f"Job {JOB}: queued, #2 in queue — queued, 42%"
    assert clock(3725) == "1:02:05" and clock(-3) == "0:00"


def test_the_preview_shows_while_the_job_runs_with_what_it_is():
    preview = {"forward": 10, "forwards": 49, "window": "1/2", "seconds": 0.4, "url": "x"}
    shown = preview_html(view(preview=preview, preview_at=1234.5))
    assert f'src="media/{JOB}.jpg?at=1234.500"' in shown and "after forward 10 of 49, window 1/2" in shown
    assert preview_html(view()) == "" and preview_html(view(status="succeeded", preview=preview)) == ""


def test_failed_and_cancelled_jobs_say_why():
    assert why(view(status="failed", error="out of GPU memory")) == "failed: out of GPU memory"
    assert why(view(status="cancelled", progress=31.0)) == "cancelled during denoise at 31%"
    assert why(view(status="cancelled", timings={}, progress=0)) == "cancelled while queued at 0%"
    assert why(view(status="succeeded")) == ""


def test_history_pages_follow_the_cursors():
    jobs = [view(id=f"{i:032x}", status="succeeded") for i in range(25)]

    def listing(limit, after=None):
        start = 0 if after is None else next(i for i, job in enumerate(jobs) if job["id"] == after) + 1
        return jobs[start : start + limit], start + limit < len(jobs)

    manager = SimpleNamespace(list=listing)
    rows, more, label = history_page(manager, [None])
    assert len(rows) == 10 and more and label == "Jobs 1-10" and rows[0][0] == jobs[0]["id"]
    rows, more, label = history_page(manager, [None, jobs[9]["id"], jobs[19]["id"]])
    assert len(rows) == 5 and not more and label == "Jobs 21-25"
    assert rows[0][:5] == [jobs[20]["id"], "completed", "a fox", "5.2", "3"]


def test_the_advanced_group_shows_a_chosen_adapters_recipe():
    listing = [
        {
            "name": "turbo",
            "recipe": dict(name="Turbo 8-step", forwards=8, num_inference_steps=9, video_shift=6.0, audio_shift=3.0),
        },  # fmt: skip
        {"name": "style", "recipe": None},
    ]
    assert recipe_note([["turbo", "Turbo", 0.0], ["style", "", 1.0]], listing) == ""
    note = recipe_note([["turbo", "Turbo", 0.8]], listing)
    assert "turbo" in note and "8 forwards (9 sigma points), shifts 6/3" in note


def test_the_sparse_attention_field_reads_what_a_user_types():
    import pytest

    from h3gen.errors import RequestError
    from h3gen.server.schemas import GenerationBody
    from h3gen.ui.actions import sparsity_of_text

    assert sparsity_of_text("") is None and sparsity_of_text(None) is None
    assert sparsity_of_text(" default ") == "default"
    assert sparsity_of_text("0.9") == 0.9 and sparsity_of_text("0.5, 0.9") == [0.5, 0.9]
    with pytest.raises(RequestError, match="sparsity must be"):
        sparsity_of_text("most")
    body = GenerationBody.model_validate({"prompt": "a fox", "sparsity": sparsity_of_text("0.9"), "dense_forwards": 2})
    assert (body.sparsity, body.dense_forwards) == (0.9, 2)
    with pytest.raises(ValueError, match="up to"):
        GenerationBody.model_validate({"prompt": "a fox", "sparsity": sparsity_of_text("1.5")})
