"""What an upload is stored as (its decoded type, never the client's name), the pixel cap read from a header, and
the aspect ratios validation accepts being ones the model runs."""

import time

import numpy as np
import pytest
from helpers.media_files import bomb_png, moving_frames, tone, write_audio, write_video
from PIL import Image

from h3gen.errors import RequestError
from h3gen.media import MAX_IMAGE_PIXELS, read_image, upload_suffix
from h3gen.pipelines.h3 import geometry


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uploads")
    picture = Image.new("RGB", (64, 48), (200, 30, 30))
    for name, fmt in (("p.upload", "PNG"), ("j.upload", "JPEG"), ("w.upload", "WEBP"), ("g.upload", "GIF")):
        picture.save(folder / name, fmt)
    write_video(folder / "v.upload", moving_frames(12, 48, 64), 24)
    write_video(folder / "va.upload", moving_frames(12, 48, 64), 24, audio=tone(0.5, 32000))
    for suffix in (".wav", ".mp3", ".m4a"):
        write_audio(folder / f"a{suffix}", tone(0.5, 32000), 32000)
        (folder / f"a{suffix}").rename(folder / f"a{suffix[1:]}.upload")
    (folder / "page.upload").write_text("<html><script>alert(1)</script></html>")
    return folder


@pytest.mark.parametrize(
    "name,kind,suffix",
    [
        ("p.upload", "image", ".png"),
        ("j.upload", "image", ".jpg"),
        ("w.upload", "image", ".webp"),
        ("g.upload", "image", ".gif"),
        ("v.upload", "video", ".mp4"),
        ("va.upload", "video", ".mp4"),
        ("awav.upload", "audio", ".wav"),
        ("amp3.upload", "audio", ".mp3"),
        ("am4a.upload", "audio", ".m4a"),
        ("va.upload", "audio", ".mp4"),  # a video given for its soundtrack
    ],
)
def test_upload_named_by_content(media, name, kind, suffix):
    assert upload_suffix(media / name, kind, "field") == suffix


@pytest.mark.parametrize(
    "name,kind,message",
    [
        ("page.upload", "image", "not a readable image"),
        ("page.upload", "video", "not a readable video"),
        ("page.upload", "audio", "not a readable audio"),
        ("p.upload", "video", "not a readable video"),
        ("awav.upload", "video", "not a readable video"),
        ("v.upload", "audio", "no audio stream"),
        ("v.upload", "image", "not a readable image"),
    ],
)
def test_upload_of_the_wrong_kind_is_refused_naming_the_field(media, name, kind, message):
    with pytest.raises(RequestError, match=message) as error:
        upload_suffix(media / name, kind, "ref_thing")
    assert error.value.field == "ref_thing" and str(media) not in str(error.value)


def test_pixel_cap_is_read_from_the_header(tmp_path):
    import resource

    path = bomb_png(tmp_path / "bomb.png")
    huge = bomb_png(tmp_path / "huge.png", 20_000, 20_000, pixels=False)  # past PIL's own bomb limit
    assert path.stat().st_size < 2**20 and 13_000 * 13_000 > MAX_IMAGE_PIXELS
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for source in (path, huge):
        for call in (
            lambda source=source: read_image(source, "image"),
            lambda source=source: upload_suffix(source, "image", "image"),
        ):
            with pytest.raises(RequestError, match="at most 40 MP") as error:
                call()
            assert error.value.field == "image" and str(tmp_path) not in str(error.value)
    assert time.perf_counter() - started < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KB: nothing was decoded
    small = bomb_png(tmp_path / "fine.png", 640, 360)
    assert read_image(small).size == (640, 360) and upload_suffix(small, "image", "image") == ".png"


def test_missing_file_message_names_the_file_not_its_folder(tmp_path):
    with pytest.raises(RequestError) as error:
        read_image(tmp_path / "deep" / "cat.png", "image")
    assert "cat.png" in str(error.value) and str(tmp_path) not in str(error.value)


UI_ASPECTS = ["16:9", "9:16", "1:1", "4:3", "3:4", "21:9", "4:1", "1:4"]
EXTREMES = ["4:1", "1:4", "3.999:1", "1:3.999", "4000:1000", "1000:4000", "3.5:1", "1:3.5", "2.39:1"]


@pytest.mark.parametrize(
    "short_edge,max_pixels,multiple",
    [
        (64, 7168, 32),  # the tiny demo model
        (geometry.CANVAS_SHORT_EDGE, geometry.CANVAS_MAX_PIXELS, 32),  # the released model
        (32, 32 * 32 * 4, 32),
        (96, 96 * 200, 32),
        (48, 48 * 48 * 3, 16),
    ],
)
def test_every_accepted_aspect_ratio_resolves_to_a_canvas_the_model_accepts(short_edge, max_pixels, multiple):
    """What validation resolves (from an aspect ratio) must pass the check the pipeline runs on explicit sizes:
    the 4:1 canvas of the tiny model once rounded to 160x32 (5:1), which every job then failed on."""
    ratios = UI_ASPECTS + EXTREMES + [f"{w:.3f}:1" for w in np.linspace(0.25, 4.0, 301)]
    for ratio in ratios:
        canvas = geometry.resolve_geometry(
            aspect_ratio=ratio, multiple=multiple, short_edge=short_edge, max_pixels=max_pixels
        )
        again = geometry.resolve_geometry(height=canvas.height, width=canvas.width, multiple=multiple)
        assert (again.height, again.width) == (canvas.height, canvas.width), ratio
    # the released model's canvases are unchanged by the bound
    assert geometry.resolve_canvas(4, 1) == (512, 2016) and geometry.resolve_canvas(16, 9) == (768, 1344)
