"""The web UI in a real browser: Playwright drives Debian's Chromium (offline flags) against `h3gen serve`."""

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.server_harness import Server

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


@contextmanager
def ui_page(server, height: int = 1000):
    """A headless Chromium page on the server's UI, loaded and ready for input."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": height})
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
        yield page
        browser.close()


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


def test_type_prompt_generate_see_progress_and_play_video(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        requests, console = [], []
        page.on("request", lambda request: requests.append(request.url))
        page.on("console", lambda message: console.append(message.text))
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
        demo_note = page.inner_text("#demo-model-note")
        page.fill("#prompt textarea", "a cat playing the piano")
        page.click("#generate-btn")

        statuses, bars, started = set(), set(), time.monotonic()
        while page.locator("#result-video video").count() == 0:
            assert time.monotonic() - started < 240, f"no video; statuses seen: {statuses}"
            statuses.add(page.input_value("#status textarea"))
            if page.locator("#progress progress").count():
                bars.add(float(page.get_attribute("#progress progress", "value")))
            time.sleep(0.05)
        page.wait_for_function(
            "() => { const v = document.querySelector('#result-video video'); return v && v.readyState >= 2 }",
            timeout=30000,
        )
        bars.add(float(page.get_attribute("#progress progress", "value")))  # the bar once the video is there
        video = page.evaluate("""() => { const v = document.querySelector('#result-video video');
            return {duration: v.duration, width: v.videoWidth, height: v.videoHeight,
                    playable: v.canPlayType('video/mp4; codecs="avc1.64001E, mp4a.40.2"')} }""")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "ui-generate.png"), full_page=True)
        final = page.input_value("#status textarea")
        history = page.inner_text("#history")
        fits = page.evaluate("""() => { const t = document.querySelector('#history table');
            return t.getBoundingClientRect().right <= document.querySelector('#history').getBoundingClientRect().right
                   + 1 }""")
        browser.close()

    assert "random weights" in demo_note and "noise" in demo_note  # the person knows the demo model serves
    assert any("%" in status and "in_progress" in status for status in statuses), statuses  # progress was shown
    assert any(0 < value < 100 for value in bars) and max(bars) == 100, bars  # and as a bar
    assert fits  # the history's columns fit the page
    assert "5.2" in history  # its seconds column shows the clip's length (124 frames at 24 fps)
    assert not [text for text in console if "Content Security Policy" in text or "Refused to" in text], console
    assert "done" in final and "124 frames" in final
    assert abs(video["duration"] - 124 / 24) < 0.1 and (video["width"], video["height"]) == (128, 64)
    assert video["playable"] in ("probably", "maybe")
    assert "completed" in history
    outside = [url for url in requests if not url.startswith(("http://127.0.0.1", "data:", "blob:"))]
    assert outside == []  # nothing reaches the internet


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
        page.fill("#steps input[type=number]", "2")
        page.press("#steps input[type=number]", "Enter")
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
        page.fill("#steps input[type=number]", "100")
        page.press("#steps input[type=number]", "Enter")
        page.click("#generate-btn")
        page.wait_for_function(
            "() => document.querySelector('#status textarea').value.includes('in_progress')", timeout=60000
        )
        page.fill("#steps input[type=number]", "2")  # the next job's settings: the running one keeps its own
        page.press("#steps input[type=number]", "Enter")
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
    assert [line for line in history.splitlines() if "cancelled" in line], history
    assert badges == []
    assert (before, after) == (200, 404)
