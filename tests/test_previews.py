"""Previews while denoising (`pipelines/h3/preview.py`) on the tiny model: what the picture is, when it comes, who
gets it; the server and UI faces are tested with them (test_server.py, test_ui_browser.py)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from h3gen.errors import RequestError
from h3gen.pipelines.h3.pipeline import H3Pipeline
from h3gen.pipelines.h3.preview import (
    MAX_SECONDS_BETWEEN,
    Preview,
    PreviewMaker,
    accepts_previews,
    default_interval,
    preview_image,
    preview_slice,
)
from h3gen.pipelines.h3.stages import denoise, draw_noise, encode_conditions, encode_text, pack
from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint
from h3gen.pipelines.h3.vae import decode_video

CANVAS = dict(height=64, width=96)


@pytest.fixture(scope="module")
def pipe():
    return H3Pipeline.from_pretrained(tiny_checkpoint(), device="cpu", torch_dtype=torch.float32, workflow="t2va")


def test_default_cadence_is_a_tenth_of_the_forwards_and_at_least_every_30_s():
    assert [default_interval(n) for n in (1, 4, 8, 10, 49, 50, 999)] == [1, 1, 1, 1, 5, 5, 100]
    now = [0.0]
    maker = PreviewMaker(None, tier="lossless", every=None, deliver=lambda preview: None, clock=lambda: now[0])
    maker.begin()
    assert [f for f in range(1, 50) if maker.due(f, 49)] == [5, 10, 15, 20, 25, 30, 35, 40, 45]
    now[0] = MAX_SECONDS_BETWEEN + 1  # a slow forward: due whatever the count
    assert maker.due(7, 49) and not maker.due(49, 49)  # never after the last forward (the real decode follows)
    explicit = PreviewMaker(None, tier="lossless", every=3, deliver=lambda preview: None)
    assert [f for f in range(1, 11) if explicit.due(f, 10)] == [3, 6, 9]


def test_only_a_callback_that_takes_a_preview_is_sent_them():
    assert accepts_previews(lambda stage, step, total, preview: None)
    assert accepts_previews(lambda stage, step, total, preview=None: None)
    assert accepts_previews(lambda *args: None)
    assert not accepts_previews(lambda stage, step, total: None)
    assert not accepts_previews(None)


@pytest.mark.parametrize("frames,start", [(7, 0), (12, 5), (17, 5), (27, 10), (31, 15), (5, 0)])
def test_preview_slice_is_one_decoder_clip_near_the_middle(frames, start):
    latents = torch.arange(frames, dtype=torch.float32).view(1, 1, frames, 1, 1)
    piece = preview_slice(latents, 5, 2)
    assert piece.shape[2] == min(frames, 7) and int(piece[0, 0, 0, 0, 0]) == start


def test_preview_equals_that_frame_of_the_whole_decode(pipe):
    torch.manual_seed(3)
    vae = pipe.vae
    latents = torch.randn(1, 24, 17, 4, 6)  # 17 latent frames = 65 frames
    whole = decode_video(vae, latents, tier="lossless")
    image = preview_image(vae, latents, "lossless")
    # The clip starting at latent 5 is the decoder's second; each clip owns tokens_chunk_size * 4 - pre-padding frames.
    per_clip = vae.tokens_chunk_size * vae.temporal_compression_ratio - vae.frame_pre_padding
    piece = decode_video(vae, latents[:, :, 5:12], tier="lossless")
    expected = whole[per_clip + piece.shape[0] // 2]
    assert image.dtype == np.uint8 and image.shape == expected.shape
    assert np.abs(image.astype(np.float32) / 255 - expected).max() <= 1 / 255 + 1e-4


def test_the_preview_decodes_the_clean_prediction(pipe):
    """At the last forward the prediction of the clean latents is what the loop ends on (sigma_next = 0)."""
    prepared = pipe.validate("a fox", num_inference_steps=4, seed=1, **CANVAS)
    parts = pipe.components
    text = encode_text(parts, prepared, lambda *a: None)
    rows = encode_conditions(parts, prepared, draw_noise(parts, prepared), lambda *a: None)
    layout = pack(prepared, text, rows.blocks, pipe.config.patch_size)
    seen = []

    class Every(PreviewMaker):
        def due(self, forward, forwards):
            return True

        def make(self, latents, forward, forwards):
            seen.append((forward, latents.clone()))

    maker = Every(parts, tier="lossless", every=1, deliver=None)
    made = denoise(pipe.transformer, prepared, text, rows, layout, lambda *a: None, device=parts.device,
                   tier="lossless", preview=maker)  # fmt: skip
    assert [forward for forward, _ in seen] == [1, 2, 3]
    assert torch.allclose(seen[-1][1], made.video, atol=1e-5)
    assert not torch.allclose(seen[0][1], made.video, atol=1e-3)  # an earlier guess differs


def test_run_sends_previews_at_the_requested_cadence_without_changing_the_clip(pipe):
    previews = []

    def callback(stage, step, total, preview=None):
        if preview is not None:
            previews.append((stage, step, total, preview))

    quiet = pipe("a fox", num_inference_steps=7, seed=2, **CANVAS)  # a three-argument callback: no previews made
    assert quiet.previews == 0
    shown = pipe("a fox", num_inference_steps=7, seed=2, preview_every=2, callback=callback, **CANVAS)
    assert [(stage, step, total) for stage, step, total, _ in previews] == [("preview", 2, 6), ("preview", 4, 6)]
    assert shown.previews == 2 and shown.preview_seconds > 0
    assert np.array_equal(shown.video, quiet.video)  # a preview reads the loop's state, never writes it
    preview = previews[0][3]
    assert isinstance(preview, Preview) and preview.image.shape == (64, 96, 3) and preview.window is None
    decoded = np.asarray(Image.open(io.BytesIO(preview.jpeg())))
    assert decoded.shape == (64, 96, 3)
    previews.clear()
    off = pipe("a fox", num_inference_steps=7, seed=2, preview_every=0, callback=callback, **CANVAS)
    assert previews == [] and off.previews == 0
    pipe("a fox", num_inference_steps=7, seed=2, callback=callback, **CANVAS)  # default: every forward of 6
    assert [step for _, step, _, _ in previews] == [1, 2, 3, 4, 5]


def test_under_offload_only_a_request_that_asks_gets_previews():
    """Each preview would bring the VAE to the GPU between forwards: an offloaded pipeline makes them when asked."""
    offloaded = H3Pipeline.from_pretrained(
        tiny_checkpoint(), device="cpu", torch_dtype=torch.float32, workflow="t2va", offload="stage"
    )
    seen = []

    def callback(stage, step, total, preview=None):
        if preview is not None:
            seen.append(step)

    assert offloaded("a fox", num_inference_steps=4, seed=2, callback=callback, **CANVAS).previews == 0
    asked = offloaded("a fox", num_inference_steps=4, seed=2, preview_every=1, callback=callback, **CANVAS)
    assert asked.previews == 2 and seen == [1, 2]


@pytest.mark.parametrize("value", [-1, 1000, 2.5, True, "3"])
def test_preview_every_out_of_range_names_the_field(pipe, value):
    with pytest.raises(RequestError) as error:
        pipe.validate("a fox", preview_every=value, **CANVAS)
    assert error.value.field == "preview_every" and "0 (no previews) to 999" in str(error.value)


def test_a_long_clip_previews_the_window_being_made(tmp_path):
    pipe = H3Pipeline.from_pretrained(tiny_checkpoint(), device="cpu", torch_dtype=torch.float32, workflow="t2va")
    previews = []
    output = pipe(
        "a long walk",
        seconds=16,
        height=64,
        width=64,
        num_inference_steps=3,
        preview_every=1,
        seed=4,
        output_path=tmp_path / "long.mp4",
        callback=lambda stage, step, total, preview=None: previews.append(preview) if preview else None,
    )
    assert output.windows == 2 and output.num_forwards == 4
    assert [(p.window, p.forward, p.forwards) for p in previews] == [((0, 2), 1, 2), ((1, 2), 1, 2)]
    assert previews[0].describe() == {"forward": 1, "forwards": 2, "window": [0, 2]}
