"""The official `openai` SDK's `client.videos` against the real server (uvicorn subprocess on 127.0.0.1, tiny
model): every call a client of OpenAI's video API makes, with the SDK's own models validating what comes back."""

import base64
import io
import warnings

import httpx
import openai
import pytest
from helpers.server_harness import Server
from openai.types import Video, VideoDeleteResponse
from PIL import Image

from h3gen.media import SPRITESHEET_COLUMNS, SPRITESHEET_ROWS, probe_mp4
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

FAST = {"num_inference_steps": 3}
LONG = {"num_inference_steps": 1000}  # about ten seconds on the tiny model
KEY = "sdk-test-key"

# Starts `h3gen serve` in a process of its own: minutes on the 2-core CI machine.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
    pytest.mark.server,
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    instance = Server(model, tmp_path_factory.mktemp("openai") / "results", max_queue=10, api_key=KEY)
    yield instance
    instance.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as sdk:
        yield sdk


def _raw(server, video_id: str) -> httpx.Response:
    with server.client() as http:
        return http.get(f"/v1/videos/{video_id}")


def _strict(server, video_id: str) -> Video:
    """The job as the SDK's `Video` model validates it (not the SDK's lenient construction of responses). `size`
    echoes the size asked for, so this holds for videos asked in one of the SDK's sizes; a video asked without a size
    reports the canvas made (e.g. 1344x768), which the SDK's type does not list."""
    return Video.model_validate(_raw(server, video_id).json())


def _png(width=40, height=24) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_create_with_model_size_seconds_then_poll_retrieve_and_download(server, client, tmp_path):
    created = client.videos.create(
        prompt="a fox in the snow", model="MiniMax-H3", size="1280x720", seconds="5", extra_body=FAST
    )
    assert created.object == "video" and created.status in ("queued", "in_progress")
    assert created.model == "MiniMax-H3" and created.size == "1280x720" and created.seconds == "5"
    Video.model_validate(created.model_dump())

    done = client.videos.poll(created.id, poll_interval_ms=100)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    video = _strict(server, created.id)
    assert video.status == "completed" and isinstance(video.created_at, int) and video.expires_at > video.completed_at
    extra = _raw(server, created.id).json()
    # the canvas made: the size's aspect ratio on H3's grid at the model's own resolution
    assert extra["request"]["aspect_ratio"] == "1280:720" and extra["width"] > extra["height"]

    content = client.videos.download_content(created.id)
    path = tmp_path / "fox.mp4"
    path.write_bytes(content.content)
    info = probe_mp4(path)
    assert (info.width, info.height) == (extra["width"], extra["height"]) and info.audio_channels == 2

    thumbnail = Image.open(io.BytesIO(client.videos.download_content(created.id, variant="thumbnail").content))
    assert thumbnail.format == "JPEG" and thumbnail.size == (info.width, info.height)

    with server.client() as http:
        sheet_response = http.get(f"/v1/videos/{created.id}/content", params={"variant": "spritesheet"})
    assert sheet_response.status_code == 200 and sheet_response.headers["content-type"] == "image/jpeg"
    sheet = Image.open(io.BytesIO(sheet_response.content))
    columns, rows = (
        int(sheet_response.headers["x-spritesheet-columns"]),
        int(sheet_response.headers["x-spritesheet-rows"]),
    )
    tile_width, tile_height = (
        int(sheet_response.headers[f"x-spritesheet-tile-{side}"]) for side in ("width", "height")
    )
    assert (columns, rows) == (SPRITESHEET_COLUMNS, SPRITESHEET_ROWS)
    assert sheet.size == (columns * tile_width, rows * tile_height)
    assert tile_width / tile_height == pytest.approx(info.width / info.height, rel=0.05)


def test_create_and_poll_waits_for_completion(server, client):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create_and_poll(prompt="rain on a window", seconds="6", size="1280x720", extra_body=FAST)
    assert video.status == "completed" and video.seconds == "6"
    raw = _raw(server, video.id)
    assert raw.headers.get("openai-poll-after-ms") is not None  # the poll helper reads it while a job runs
    _strict(server, video.id)


def test_list_pages_with_the_cursor(server, client):
    ids = [client.videos.create(prompt=f"clip {i}", size="1792x1024", extra_body=FAST).id for i in range(3)]
    for video_id in ids:
        client.videos.poll(video_id, poll_interval_ms=100)
    page = client.videos.list(limit=2, order="asc")
    assert len(page.data) == 2 and page.has_more
    seen = [video.id for video in client.videos.list(limit=2, order="desc")]  # auto-paging follows last_id
    assert set(ids) <= set(seen) and len(seen) == len(set(seen))
    for video in page.data:
        Video.model_validate(video.model_dump())


def test_remix_keeps_the_settings_with_a_new_prompt(server, client):
    source = client.videos.poll(
        client.videos.create(prompt="a boat", size="720x1280", seconds="5", extra_body={**FAST, "seed": 11}).id,
        poll_interval_ms=100,
    )
    remix = client.videos.remix(source.id, prompt="a boat at night")
    assert remix.remixed_from_video_id == source.id and remix.prompt == "a boat at night"
    done = client.videos.poll(remix.id, poll_interval_ms=100)
    assert done.status == "completed" and done.size == source.size and done.seconds == source.seconds
    request = _raw(server, remix.id).json()["request"]
    assert request["seed"] == 11 and request["num_inference_steps"] == FAST["num_inference_steps"]
    with pytest.raises(openai.NotFoundError):
        client.videos.remix("0" * 32, prompt="nothing to remix")


def test_delete_answers_the_sdk_shape_and_cancel_reads_as_failed(server, client):
    finished = client.videos.poll(
        client.videos.create(prompt="to delete", size="1024x1792", extra_body=FAST).id, poll_interval_ms=100
    )
    deleted = client.videos.delete(finished.id)
    assert deleted.object == "video.deleted" and deleted.deleted and deleted.id == finished.id
    VideoDeleteResponse.model_validate(deleted.model_dump())
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(finished.id)

    running = client.videos.create(prompt="long", size="720x1280", extra_body=LONG)
    cancelled = client.videos.delete(running.id)
    assert cancelled.object == "video.deleted"
    video = client.videos.poll(running.id, poll_interval_ms=100)
    assert video.status == "failed" and video.error.code == "cancelled"
    _strict(server, running.id)


def test_input_reference_as_a_file_and_as_a_data_url(server, client):
    from_file = client.videos.create(
        prompt="the picture comes alive",
        size="720x1280",
        input_reference=("start.png", _png(), "image/png"),
        extra_body=FAST,
    )
    # The SDK sends files only; an `{image_url}` reference goes as JSON (as OpenAI's HTTP API takes it).
    data_url = "data:image/png;base64," + base64.b64encode(_png(24, 40)).decode()
    with server.client() as http:
        response = http.post(
            "/v1/videos", json={"prompt": "the picture comes alive", **FAST, "input_reference": {"image_url": data_url}}
        )
    assert response.status_code == 202, response.text
    from_url = Video.construct(**response.json())  # no size asked: `size` is the canvas made (not an SDK size)
    _strict(server, from_file.id)
    for video in (from_file, from_url):
        done = client.videos.poll(video.id, poll_interval_ms=100)
        assert done.status == "completed", done.error
        assert _raw(server, video.id).json()["request"]["task"] == "fl2va"
    # the first keyframe's aspect ratio sets the canvas when no size is given
    raw = _raw(server, from_url.id).json()
    assert raw["height"] > raw["width"]


@pytest.mark.parametrize(
    "fields, exception, words",
    [
        ({"seconds": "4"}, openai.UnprocessableEntityError, "from 5"),
        ({"seconds": "61"}, openai.UnprocessableEntityError, "5 to 60"),  # over the server's --max-seconds
        ({"size": "5000x100"}, openai.UnprocessableEntityError, "nearest"),
        ({"size": "big"}, openai.UnprocessableEntityError, "1280x720"),
        ({"model": "sora-2"}, openai.UnprocessableEntityError, "MiniMax-H3"),
    ],
)
def test_bad_values_are_the_sdks_4xx_exceptions(client, fields, exception, words):
    with pytest.raises(exception) as caught:
        client.videos.create(prompt="bad", **fields)
    assert caught.value.status_code < 500 and words in str(caught.value)


@pytest.mark.parametrize(
    "reference, words",
    [
        ({"image_url": "https://example.com/a.png"}, "never fetches"),
        ({"image_url": "data:text/html;base64,PGgxPg=="}, "base64 image"),
        ({"image_url": "data:image/png;base64,***"}, "base64"),
        ({"file_id": "file-123"}, "keeps no files"),
    ],
)
def test_input_references_the_server_cannot_resolve(server, reference, words):
    with server.client() as http:
        as_json = http.post("/v1/videos", json={"prompt": "bad", "input_reference": reference})
        parts = [("prompt", (None, "bad"))] + [(f"input_reference[{k}]", (None, v)) for k, v in reference.items()]
        as_form = http.post("/v1/videos", files=parts)  # multipart text parts, as OpenAI's SDK sends an object
    for response in (as_json, as_form):
        assert response.status_code == 422 and words in response.text, response.text


def test_unknown_ids_and_variants(client):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("0" * 32)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content("0" * 32)
    video = client.videos.poll(client.videos.create(prompt="variants", extra_body=FAST).id, poll_interval_ms=100)
    with pytest.raises(openai.UnprocessableEntityError):
        client.videos.download_content(video.id, variant="poster")  # type: ignore[arg-type]


def test_models_lists_the_served_model_and_its_tasks(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["MiniMax-H3"]
    assert set(models.data[0].model_extra["tasks"]) == {"t2va", "fl2va", "ref2va"}


@pytest.mark.parametrize("asked, shown", [(None, "5"), (5.1, "5.1"), (6, "6")])
def test_seconds_is_the_length_asked_for_on_every_path(server, client, asked, shown):
    """`seconds` answers the length asked for (or the default that applied), the same in OpenAI's object and in the
    job's request; `duration` is the length made (17n + 5 frames at 24 fps)."""
    extra = {} if asked is None else {"seconds": str(asked)}
    created = client.videos.create(prompt="a cat", size="1280x720", extra_body={"num_inference_steps": 2}, **extra)
    assert created.seconds == shown
    view = _raw(server, created.id).json()
    assert view["seconds"] == shown and view["request"]["seconds"] == float(shown)
    assert view["request"]["duration"] >= float(shown)
    with server.client() as http:
        http.delete(f"/v1/videos/{created.id}")
