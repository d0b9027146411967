"""The web UI in a real browser: Playwright drives Debian's Chromium (offline flags) against `h3gen serve`."""

import os
import shutil
import time
from pathlib import Path

import pytest
from server_harness import Server

from h3gen.pipelines.h3.tiny import tiny_checkpoint

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OFFLINE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

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
        requests = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
        page.fill("#prompt textarea", "a cat playing the piano")
        page.click("#generate-btn")

        statuses, started = set(), time.monotonic()
        while page.locator("#result-video video").count() == 0:
            assert time.monotonic() - started < 90, f"no video; statuses seen: {statuses}"
            statuses.add(page.input_value("#status textarea"))
            time.sleep(0.05)
        page.wait_for_function(
            "() => { const v = document.querySelector('#result-video video'); return v && v.readyState >= 2 }",
            timeout=30000)
        video = page.evaluate("""() => { const v = document.querySelector('#result-video video');
            return {duration: v.duration, width: v.videoWidth, height: v.videoHeight,
                    playable: v.canPlayType('video/mp4; codecs="avc1.64001E, mp4a.40.2"')} }""")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "ui-generate.png"), full_page=True)
        final = page.input_value("#status textarea")
        history = page.inner_text("#history")
        browser.close()

    assert any("%" in status and "running" in status for status in statuses), statuses  # progress was shown
    assert "done" in final and "124 frames" in final
    assert abs(video["duration"] - 124 / 24) < 0.1 and (video["width"], video["height"]) == (128, 64)
    assert video["playable"] in ("probably", "maybe")
    assert "succeeded" in history
    outside = [url for url in requests if not url.startswith(("http://127.0.0.1", "data:", "blob:"))]
    assert outside == []  # nothing reaches the internet


def test_ref2va_with_uploaded_references(server, tmp_path):
    from media_files import tone, write_audio
    from PIL import Image
    from playwright.sync_api import sync_playwright

    Image.new("RGB", (60, 90), (30, 90, 200)).save(tmp_path / "person.png")
    write_audio(tmp_path / "voice.m4a", tone(6.1, 48000), 48000)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=OFFLINE_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.goto(f"{server.url}/ui/", wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=30000)
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
        browser.close()
    assert "done" in final and "124 frames" in final, final  # the UI's seconds slider (5 s) sets the length
