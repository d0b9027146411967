"""The web UI in a real browser: Playwright drives Debian's Chromium (offline flags) against `h3gen serve`."""

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers.server_harness import Server, wait_for
from PIL import Image

from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

# Starts `h3gen serve` or the CLI in processes of their own: minutes on the 2-core CI machine.
pytestmark = [pytest.mark.server, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OFFLINE_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# The rows a person sees in a Gradio 6 table (its <tbody> is a hidden copy that sizes the columns).
HISTORY_ROWS = "#history [role=row].virtual-row"


@contextmanager
def ui_page(server, height: int = 1000, width: int = 1400):
    """A headless Chromium page on the server's UI, loaded and ready for input."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
        yield page
        browser.close()


def set_steps(page, steps: int) -> None:
    """Set Steps in the Advanced group (opened first when it is closed), and wait until the slider holds it: the
    slider takes a typed number on its change event, which a click at once after can overtake (then the old value
    would be sent)."""
    field = page.locator("#steps input[type=number]")
    if not field.is_visible():
        page.click("#advanced")
        field.wait_for(state="visible", timeout=10000)
    from playwright.sync_api import TimeoutError as NotYet

    held = f"() => document.querySelector('#steps input[type=range]').value === '{steps}'"
    for _ in range(3):
        field.fill(str(steps))
        field.press("Enter")
        field.press("Tab")  # leaving the box is a change event too
        try:
            page.wait_for_function(held, timeout=3000)
            return
        except NotYet:  # the typed value was not taken: type it again
            continue
    page.wait_for_function(held, timeout=3000)


def wait_for_video(page, server, seconds: float) -> None:
    """Wait for the result player; past `seconds`, fail with what the page and the server say about the jobs."""
    deadline = time.monotonic() + seconds
    while not page.locator("#result-video video").is_visible():
        if time.monotonic() > deadline:
            with server.client() as rest:
                jobs = [
                    (
                        job["request"]["prompt"],
                        job["request"].get("num_inference_steps"),
                        job["job_status"],
                        job.get("error"),
                    )
                    for job in rest.get("/v1/videos").json()["data"]
                ]
            log = server.log_path.read_text()[-2000:]
            raise AssertionError(
                f"no video in {seconds} s; status {page.input_value('#status textarea')!r}; "
                f"jobs {jobs}; server log:\n{log}"
            )
        time.sleep(0.2)


if not Path(CHROMIUM).exists():
    # CI installs Chromium (.ci/run); there a missing browser is a failure, not a skip.
    if os.environ.get("CI"):
        raise RuntimeError("Chromium is missing: `apt-get install -y chromium` (see README).")
    pytest.skip("Chromium is not installed (apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    instance = Server(tiny_checkpoint(cache_dir=root / "cache"), root / "results", ui=True)
    yield instance
    instance.stop()


def box(page, selector: str) -> dict | None:
    """Where an element is on the page (CSS pixels), or None when it is not shown."""
    locator = page.locator(selector).first
    return locator.bounding_box() if locator.count() and locator.is_visible() else None


def pixels(path: Path, where: dict) -> np.ndarray:
    """The screenshot's pixels (RGB) inside an element's box."""
    image = np.asarray(Image.open(path).convert("RGB"))
    x, y = int(where["x"]), int(where["y"])
    return image[y : y + int(where["height"]), x : x + int(where["width"])]


def in_view(where: dict | None, width: int = 1366, height: int = 768) -> bool:
    return (
        where is not None
        and where["x"] >= 0
        and where["y"] >= 0
        and where["x"] + where["width"] <= width
        and (where["y"] + where["height"] <= height)
    )


def test_a_job_at_1366x768_shows_progress_a_preview_then_plays_and_the_history_follows(server):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        requests, console = [], []
        page.on("request", lambda request: requests.append(request.url))
        page.on("console", lambda message: console.append(message.text))
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
        demo_note = page.inner_text("#demo-model-note")
        before = {name: box(page, f"#{name}") for name in ("prompt", "task", "generate-btn", "cancel-btn", "status")}
        hidden = {name: box(page, f"#{name}") for name in ("keyframes", "references", "windows", "steps")}
        page.screenshot(path=str(ARTIFACTS / "ui-before.png"))
        generate_pixels = pixels(ARTIFACTS / "ui-before.png", before["generate-btn"])

        page.fill("#prompt textarea", "a cat playing the piano")
        set_steps(page, 100)  # in the Advanced group, which opens on a click
        page.fill("#preview-every input", "10")
        page.press("#preview-every input", "Enter")
        page.click("#generate-btn")
        statuses, bars, previews, started = set(), set(), set(), time.monotonic()
        while page.locator("#result-video video").count() == 0:
            assert time.monotonic() - started < 240, f"no video; statuses seen: {statuses}"
            statuses.add(page.input_value("#status textarea"))
            if page.locator("#progress progress").count():
                bars.add(float(page.get_attribute("#progress progress", "value")))
            image = page.locator("#preview img")
            if image.count() and len(previews) < 3:
                loaded = page.evaluate(
                    "() => { const i = document.querySelector('#preview img'); "
                    "return i && i.complete && i.naturalWidth > 0 ? i.getAttribute('src') : null }"
                )
                if loaded and loaded not in previews:
                    previews.add(loaded)
                    page.screenshot(path=str(ARTIFACTS / "ui-during.png"))
                    during = {"preview": box(page, "#preview img"), "progress": box(page, "#progress")}
                    caption = page.inner_text("#preview")
            time.sleep(0.05)
        page.wait_for_function(
            "() => { const v = document.querySelector('#result-video video'); return v && v.readyState >= 2 }",
            timeout=30000,
        )
        bars.add(float(page.get_attribute("#progress progress", "value")))  # the bar once the video is there
        page.screenshot(path=str(ARTIFACTS / "ui-after.png"))
        video = page.evaluate("""() => { const v = document.querySelector('#result-video video');
            return {duration: v.duration, width: v.videoWidth, height: v.videoHeight,
                    playable: v.canPlayType('video/mp4; codecs="avc1.64001E, mp4a.40.2"')} }""")
        final = page.input_value("#status textarea")
        preview_after = page.locator("#preview img").count()
        job_id = final.split()[1].rstrip(":")
        page.wait_for_function(  # the history follows the job without a reload
            f"() => document.querySelector('#history').innerText.includes('{job_id}')", timeout=30000
        )
        page.wait_for_function(
            "() => [...document.querySelectorAll(HISTORY_ROWS)].some(r => r.innerText.includes('completed'))".replace(
                "HISTORY_ROWS", repr(HISTORY_ROWS)
            ),
            timeout=30000,
        )
        history = page.inner_text("#history")
        one_line = page.locator(HISTORY_ROWS).first.locator("[role=gridcell]").first.bounding_box()["height"] < 40
        # On a fresh page (no player yet), a click on the job's row plays its clip.
        page.reload(wait_until="load")
        page.wait_for_selector(HISTORY_ROWS, timeout=30000)
        row = page.locator(HISTORY_ROWS).filter(has_text=job_id).first
        row.locator("[role=gridcell]").first.click()
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('playing its video')", timeout=30000
        )
        page.wait_for_selector("#result-video video", timeout=10000)
        played = page.locator("#result-video video").count()
        browser.close()

    assert "random weights" in demo_note and "noise" in demo_note  # the person knows the demo model serves
    # The controls that start and stop a job are in view at 1366x768 without scrolling; the other tasks' inputs and
    # the Advanced settings are not shown.
    assert all(in_view(where) for where in before.values()), before
    assert before["generate-btn"]["y"] < 500 and before["cancel-btn"]["y"] == before["generate-btn"]["y"]
    assert all(where is None for where in hidden.values()), hidden
    red, green, blue = generate_pixels.reshape(-1, 3).mean(axis=0)  # the screenshot shows the orange button there
    assert red > 180 and 60 < green < 170 and blue < 100, (red, green, blue)
    assert any("%" in status and "in_progress" in status and "elapsed" in status for status in statuses), statuses
    assert any("left" in status for status in statuses), statuses  # the time left, once a forward is measured
    assert any(0 < value < 100 for value in bars) and max(bars) == 100, bars
    # Previews came while it ran, under the progress bar, each a new picture of noise (random weights).
    assert len(previews) >= 2, previews
    assert during["preview"]["y"] >= during["progress"]["y"] + during["progress"]["height"] - 1, during
    shown = pixels(ARTIFACTS / "ui-during.png", during["preview"])
    assert shown.std() > 5, shown.std()  # a picture, not a blank box (a blank one: 0)
    assert "Preview" in caption and "of 99" in caption, caption
    assert preview_after == 0  # the clip replaces the preview
    assert "done" in final and "124 frames" in final and "99 forwards" in final, final
    assert abs(video["duration"] - 124 / 24) < 0.1 and (video["width"], video["height"]) == (128, 64)
    assert video["playable"] in ("probably", "maybe")
    assert job_id in history and len(job_id) == 32 and "5.2" in history and one_line
    assert played == 1
    assert not [text for text in console if "Content Security Policy" in text or "Refused to" in text], console
    outside = [url for url in requests if not url.startswith(("http://127.0.0.1", "data:", "blob:"))]
    assert outside == []  # nothing reaches the internet


def test_the_inputs_follow_the_task_and_the_length(server):
    with ui_page(server, height=768, width=1366) as page:
        seen = {}
        for task in ("fl2va", "ref2va", "t2va"):
            page.locator("#task").get_by_text(task).click()
            page.wait_for_timeout(400)
            seen[task] = {name: box(page, f"#{name}") is not None for name in ("image", "last-image", "references")}
        page.fill("#seconds input[type=number]", "20")
        page.press("#seconds input[type=number]", "Enter")
        page.wait_for_selector("#window-prompts", state="visible", timeout=10000)
        windows = box(page, "#window-prompts")
        page.screenshot(path=str(ARTIFACTS / "ui-long-clip.png"))
        generate = box(page, "#generate-btn")
    assert seen["fl2va"] == {"image": True, "last-image": True, "references": False}, seen
    assert seen["ref2va"] == {"image": False, "last-image": False, "references": True}, seen
    assert seen["t2va"] == {"image": False, "last-image": False, "references": False}, seen
    assert windows is not None and windows["y"] > generate["y"] and in_view(generate)


def test_history_rows_follow_their_jobs_and_page_past_the_first(server):
    with ui_page(server) as page, server.client() as rest:
        # Jobs submitted elsewhere (the REST API) after the page loaded: their rows come and follow them.
        ids = [
            rest.post("/v1/videos", json={"prompt": f"page {i}", "num_inference_steps": 2, "seed": i}).json()["id"]
            for i in range(11)
        ]
        seen = set()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            rows = page.locator(HISTORY_ROWS).filter(has_text=ids[-1])
            if rows.count():
                seen.add(rows.first.inner_text().split()[1])
                if "completed" in seen:
                    break
            time.sleep(0.2)
        for job_id in ids:
            wait_for(rest, job_id)
        page.wait_for_function(
            "() => document.querySelector('#history-page').innerText.includes('Jobs 1-10')", timeout=30000
        )
        first = page.inner_text("#history")
        page.click("#history-older")
        page.wait_for_function(
            "() => document.querySelector('#history-page').innerText.includes('Jobs 11-')", timeout=30000
        )
        second = page.inner_text("#history")
        page.click("#history-newer")
        page.wait_for_function(
            "() => document.querySelector('#history-page').innerText.includes('Jobs 1-10')", timeout=30000
        )
    assert "completed" in seen and len(seen) >= 2, seen  # queued or in_progress first, then completed, no reload
    assert ids[-1] in first and ids[0] not in first  # newest first, ten a page
    assert ids[-1] not in second and ids[0] in second


def test_ref2va_with_uploaded_references(server, tmp_path):
    from helpers.media_files import tone, write_audio
    from PIL import Image

    Image.new("RGB", (60, 90), (30, 90, 200)).save(tmp_path / "person.png")
    write_audio(tmp_path / "voice.m4a", tone(6.1, 48000), 48000)
    with ui_page(server, height=1200) as page:
        page.fill("#prompt textarea", "<Picture 1> says hello with <Audio 1>")
        page.locator("#task").get_by_text("ref2va").click()
        with page.expect_file_chooser() as chooser:  # as a person does it: click the drop zone, pick two files
            page.locator("#references").get_by_text("Click to Upload").click()
        chooser.value.set_files([str(tmp_path / "person.png"), str(tmp_path / "voice.m4a")])
        started = time.monotonic()  # the upload goes to the server first; on a loaded machine that takes a while
        while "voice" not in page.inner_text("#references"):  # the name and its suffix are separate elements
            assert time.monotonic() - started < 120, page.inner_text("#references")
            time.sleep(0.2)
        set_steps(page, 2)
        page.click("#generate-btn")
        started = time.monotonic()
        while page.locator("#result-video video").count() == 0:
            assert time.monotonic() - started < 90, page.input_value("#status textarea")
            time.sleep(0.1)
        final = page.input_value("#status textarea")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "ui-ref2va.png"), full_page=True)
    assert "done" in final and "124 frames" in final, final  # the UI's seconds slider (5 s) sets the length


def visible_error_badges(page) -> list[str]:
    """Gradio's red "Error" markers on output components (shown when an event handler raises)."""
    return page.evaluate("""() => [...document.querySelectorAll('.error, .toast-body.error')]
        .filter(e => e.offsetParent !== null).map(e => e.innerText)""")


def test_empty_prompt_is_one_message_in_status(server):
    with ui_page(server) as page:
        page.click("#generate-btn")
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('prompt')", timeout=30000
        )
        status = page.input_value("#status textarea")
        time.sleep(0.5)
        badges = visible_error_badges(page)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "ui-empty-prompt.png"), full_page=True)
    assert "Write a prompt first" in status and "4000 characters" in status, status
    assert badges == []


def test_cancel_running_then_delete_finished(server):
    with ui_page(server) as page:
        page.fill("#prompt textarea", "a long walk on the beach")
        set_steps(page, 100)
        page.click("#generate-btn")
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('in_progress')", timeout=60000
        )
        set_steps(page, 2)  # the next job's settings: the running one keeps its own
        page.fill("#prompt textarea", "a short one")
        page.click("#cancel-btn")
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('cancelled')", timeout=30000
        )
        # Generate right after Cancel starts the next job: the cancelled job's generate event no longer holds the
        # button (a click while an event is pending would be dropped).
        page.click("#generate-btn")
        wait_for_video(page, server, 240)  # on a busy CPU
        page.wait_for_function(
            "() => document.querySelector('#history').innerText.includes('cancelled')", timeout=30000
        )
        history = page.inner_text("#history")
        badges = visible_error_badges(page)
        src = page.get_attribute("#result-video video", "src")  # a finished job: Cancel deletes it and its video
        before = page.request.get(f"{server.url}/ui/{src}").status
        page.click("#cancel-btn")
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('deleted')", timeout=30000
        )
        after = page.request.get(f"{server.url}/ui/{src}").status
    with server.client() as rest:
        jobs = rest.get("/v1/videos").json()["data"]
    cancelled = next(job for job in jobs if job["request"]["prompt"] == "a long walk on the beach")
    assert cancelled["job_status"] == "cancelled" and cancelled["id"][:8] in history  # its row says so
    assert [line for line in history.splitlines() if "cancelled during denoise at" in line], history
    assert badges == []
    assert (before, after) == (200, 404)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-key")
    instance = Server(tiny_checkpoint(cache_dir=root / "cache"), root / "results", ui=True, api_key=KEY)
    yield instance
    instance.stop()


KEY = "-the key 42"  # begins with '-' and holds a space: passed as one argument


def test_login_keeps_the_user_name_says_what_went_wrong_and_shows_the_lock_out(keyed_server):
    from playwright.sync_api import sync_playwright

    url = f"{keyed_server.url}/ui/"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        page.goto(url, wait_until="load")
        page.fill("#login-user", "ana")
        page.fill("#login-key", "wrong")
        page.click("#login-button")
        page.wait_for_function("() => document.querySelector('#login-message').innerText.includes('Wrong')")
        wrong = page.inner_text("#login-message")
        kept = page.input_value("#login-user")
        page.screenshot(path=str(ARTIFACTS / "ui-login-wrong.png"))
        message_box = box(page, "#login-message")
        page.fill("#login-user", "")  # any user name will do, none too
        page.fill("#login-key", KEY)
        page.click("#login-button")
        page.wait_for_selector("#prompt textarea", timeout=60000)  # the UI itself, after the reload
        logged_in = box(page, "#generate-btn")
        # Another browser without the cookie: wrong logins until the server locks it out, then one more in the page.
        other = browser.new_page(viewport={"width": 1366, "height": 768})
        other.goto(url, wait_until="load")
        answers = [other.request.post(f"{url}login", form={"username": "x", "password": "no"}).status for _ in range(9)]
        other.fill("#login-user", "bo")
        other.fill("#login-key", "still wrong")
        other.click("#login-button")
        other.wait_for_function("() => document.querySelector('#login-message').innerText.includes('try again in')")
        locked = other.inner_text("#login-message")
        disabled = other.locator("#login-button").is_disabled()
        other.screenshot(path=str(ARTIFACTS / "ui-login-locked.png"))
        browser.close()
    assert "Wrong API key" in wrong and kept == "ana", (wrong, kept)
    assert in_view(message_box) and in_view(logged_in)
    assert 429 in answers, answers
    assert "Too many wrong logins" in locked and " s." in locked and disabled, locked
