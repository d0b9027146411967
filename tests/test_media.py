"""MP4 writing and checking, and keyframe image reading."""

import numpy as np
import pytest
from PIL import Image

from h3gen.errors import RequestError
from h3gen.media import MediaError, MediaInfo, check_mp4, probe_mp4, read_image, write_mp4


def _clip(frames=30, height=48, width=80, seconds=None):
    rng = np.random.default_rng(0)
    video = rng.random((frames, height, width, 3), dtype=np.float32)
    samples = int((seconds or frames / 24) * 32000)
    audio = (rng.random((2, samples), dtype=np.float32) - 0.5) * 0.5
    return video, audio


def test_roundtrip_and_audio_fitted_to_the_picture(tmp_path):
    video, audio = _clip(seconds=3.0)  # longer audio is trimmed to the 30 frames of picture
    info = write_mp4(tmp_path / "a.mp4", video, audio)
    assert (info.num_frames, info.width, info.height, info.fps) == (30, 80, 48, 24)
    assert info.audio_channels == 2 and info.sample_rate == 32000
    assert abs(info.audio_seconds - 30 / 24) <= 1 / 24
    assert probe_mp4(tmp_path / "a.mp4") == info


def test_pictures_survive_encoding(tmp_path):
    import av

    video = np.zeros((24, 64, 64, 3), dtype=np.float32)
    video[:, :, :32, 0] = 1.0  # left half red
    write_mp4(tmp_path / "b.mp4", video, np.zeros((2, 32000), dtype=np.float32))
    with av.open(str(tmp_path / "b.mp4")) as container:
        frame = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert frame[:, :24, 0].mean() > 200 and frame[:, 40:, 0].mean() < 40


def test_rejects_bad_rates_and_odd_sizes(tmp_path):
    video, audio = _clip()
    with pytest.raises(RequestError, match="audio_sample_rate"):
        write_mp4(tmp_path / "c.mp4", video, audio, audio_sample_rate=44100)
    with pytest.raises(ValueError, match="even"):
        write_mp4(tmp_path / "c.mp4", video[:, :47], audio)
    assert not (tmp_path / "c.mp4").exists()


def test_check_names_every_mismatch():
    info = MediaInfo(
        num_frames=10,
        width=64,
        height=32,
        fps=25.0,
        video_seconds=0.4,
        audio_channels=1,
        sample_rate=44100,
        audio_seconds=1.0,
    )
    with pytest.raises(MediaError) as error:
        check_mp4(info, num_frames=12, width=64, height=64, fps=24, sample_rate=32000)
    for part in ("10 frames instead of 12", "size 64x32", "25 fps", "1 audio channels", "44100 Hz", "audio lasts"):
        assert part in str(error.value)


def test_probe_rejects_a_file_that_is_not_video(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00" * 1000)
    with pytest.raises(MediaError):
        probe_mp4(bad)


def test_read_image_sources_and_errors(tmp_path):
    rgba = Image.new("RGBA", (10, 6), (1, 2, 3, 4))
    assert read_image(rgba).mode == "RGB"
    path = tmp_path / "k.png"
    rgba.save(path)
    assert read_image(path).size == (10, 6)
    assert read_image(np.zeros((6, 10, 3), dtype=np.uint8)).size == (10, 6)
    (tmp_path / "t.txt").write_text("hello")
    for bad, message in (
        (tmp_path / "t.txt", "not a readable image"),
        (tmp_path / "missing.png", "does not exist"),
        (np.zeros((6, 10), dtype=np.float32), "uint8"),
    ):
        with pytest.raises(RequestError, match=message) as info:
            read_image(bad, "last_image")
        assert info.value.field == "last_image"


def test_the_encoder_is_nvenc_only_where_it_opens(monkeypatch, tmp_path):
    """NVENC is chosen where it opens (a GPU with a video encoder); elsewhere, and when FFmpeg lacks it, x264."""
    import av
    import numpy as np

    from h3gen import media

    media.nvenc_available.cache_clear()
    monkeypatch.setattr(av, "codecs_available", set(av.codecs_available) - {media.NVENC})
    assert not media.nvenc_available() and media.video_encoder() == "libx264"
    media.nvenc_available.cache_clear()
    monkeypatch.undo()
    expected = "h264_nvenc" if media.nvenc_available() else "libx264"
    writer = media.Mp4Writer(tmp_path / "clip.mp4", width=64, height=48)
    assert writer.encoder == expected
    writer.add_frames(np.full((24, 48, 64, 3), 0.5, np.float32))
    writer.add_audio(np.zeros((2, 32000), np.float32))
    info = writer.close()
    assert (info.num_frames, info.width, info.height) == (24, 64, 48)


def test_frames_converted_to_yuv420_by_torch_match_ffmpegs_own_conversion():
    """`rgb_to_yuv420` (the pipeline converts on the GPU) against FFmpeg's swscale on the same frame: the same BT.601
    limited-range planes, luma within rounding, chroma within its 2x2 filter's difference."""
    import av
    import numpy as np
    import torch

    from h3gen.media import rgb_to_yuv420

    rng = np.random.default_rng(0)
    smooth = np.linspace(0, 1, 96 * 64 * 3, dtype=np.float32).reshape(64, 96, 3)
    frame = np.clip(smooth + rng.normal(0, 0.05, (64, 96, 3)).astype(np.float32), 0, 1)
    theirs = av.VideoFrame.from_ndarray((frame * 255).round().astype(np.uint8), format="rgb24")
    theirs = theirs.reformat(format="yuv420p").to_ndarray().astype(int)
    ours = rgb_to_yuv420(torch.from_numpy(frame[None])).numpy()[0].astype(int)
    assert ours.shape == theirs.shape == (96, 96)
    assert np.abs(ours[:64] - theirs[:64]).mean() < 0.3 and np.abs(ours[:64] - theirs[:64]).max() <= 1
    assert np.abs(ours[64:] - theirs[64:]).mean() < 1.5
