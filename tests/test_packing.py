"""Packed layouts, row timesteps and request geometry against diffusers' MiniMax-H3 blocks."""

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as ref_mp
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)

from h3gen.errors import RequestError
from h3gen.pipelines.h3 import geometry
from h3gen.pipelines.h3.packing import build_layout, patchify_video, row_timesteps, unpatchify_video

# (height, width, num_frames, text tags, keyframe anchors): several canvases, lengths and keyframe choices.
LAYOUT_CASES = [
    (64, 96, 124, 74, ()),
    (768, 1344, 124, 128, ()),
    (1344, 768, 345, 33, ("first",)),
    (512, 2016, 192, 9, ("last",)),
    (768, 768, 260, 57, ("first", "last")),
    (96, 64, 311, 1, ("last", "first")),
]


def _text_tags(num_text: int, vision: bool) -> torch.Tensor:
    tags = torch.ones(num_text, dtype=torch.long)
    if vision and num_text > 4:
        tags[2 : num_text - 1] = 0  # rows of a keyframe's vision block are tagged video
    return tags


@pytest.mark.parametrize("height,width,num_frames,num_text,anchors", LAYOUT_CASES)
def test_layout_equals_diffusers(height, width, num_frames, num_text, anchors):
    tags = _text_tags(num_text, vision=bool(anchors))
    latent_frames = geometry.video_latent_frames(num_frames)
    audio = geometry.audio_latent_frames(num_frames)
    ours = build_layout(tags, latent_frames, height // 16, width // 16, audio, keyframe_anchors=anchors)
    ref = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, height // 16, width // 16, audio, (1, 2, 2), 2, 2, 0, keyframe_anchors=anchors
    )
    assert torch.equal(ours.position_ids, ref[0]) and ours.position_ids.dtype == torch.float64
    for got, expected in zip(
        (ours.token_tags, ours.video_indices, ours.audio_indices, ours.text_indices), ref[1:5], strict=True
    ):
        assert torch.equal(got, expected)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ref[5], ref[6])


@pytest.mark.parametrize("height,width,num_frames,num_text,anchors", LAYOUT_CASES[:4])
def test_row_timesteps_equal_diffusers(height, width, num_frames, num_text, anchors):
    lf, audio = geometry.video_latent_frames(num_frames), geometry.audio_latent_frames(num_frames)
    layout = build_layout(num_text, lf, height // 16, width // 16, audio, keyframe_anchors=anchors)
    for video_t, audio_t in ((0.0, 0.0), (0.0417, 0.1429), (0.8, 0.4), (0.9995, 0.97)):
        cond = max(video_t, 0.999)
        ours = row_timesteps(layout, video_t, audio_t, cond)
        ref = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_indices,
            layout.audio_indices,
            layout.num_condition_video_rows,
            0,
            num_text,
            video_t,
            audio_t,
            cond,
            1.0,
        )
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_worked_example_from_model_doc():
    # docs/model.md, "Worked example": 64x96 canvas, 124 frames, T = 74.
    layout = build_layout(74, 37, 4, 6, 207)
    assert layout.sequence_length == 710
    assert layout.audio_indices[0] == 74 and layout.video_indices[0] == 488
    assert layout.position_ids[74].tolist() == pytest.approx([74, 0, -3.596], abs=1e-3)
    assert layout.position_ids[74 + 207].tolist() == pytest.approx([74, 0, 22.532], abs=1e-3)
    assert layout.position_ids[488 + 6, 0].item() == pytest.approx(75.667, abs=1e-3)


def test_patchify_roundtrip_and_equals_diffusers():
    latents = torch.randn(1, 24, 5, 6, 10)
    rows = patchify_video(latents)
    assert torch.equal(rows, patchify_video_latents(latents, (1, 2, 2)))
    assert torch.equal(unpatchify_video(rows, 5, 6, 10), latents)


@pytest.mark.parametrize("aspect", [(16, 9), (9, 16), (1, 1), (4, 3), (4, 1), (1, 4), (21, 9), (7, 5)])
def test_canvas_equals_diffusers(aspect):
    ours = geometry.resolve_canvas(*aspect)
    assert ours == ref_mp.resolve_canvas_size(*aspect, 32, 768, 768 * 1344)


def test_canvas_examples():
    assert geometry.resolve_canvas(16, 9) == (768, 1344)
    assert geometry.resolve_canvas(4, 1) == (512, 2016)


@pytest.mark.parametrize("frames", [1, 120, 121, 124, 125, 300, 345, 346])
def test_frame_alignment_equals_diffusers(frames):
    aligned = geometry.align_num_frames(frames)
    assert aligned == ref_mp.align_num_frames(frames, 17, 5)
    assert geometry.video_latent_frames(aligned) == ref_mp.video_latent_num_frames(aligned, 17, 5)
    assert geometry.audio_latent_frames(aligned) == ref_mp.audio_latent_num_frames(aligned)


def test_geometry_limits_and_messages():
    g = geometry.resolve_geometry(aspect_ratio="16:9", seconds=5)
    assert (g.height, g.width, g.num_frames, g.num_latent_frames, g.num_audio_latents) == (768, 1344, 124, 37, 207)
    assert geometry.resolve_geometry(seconds=15).num_frames == 345  # 15 s snaps to the longest valid count
    with pytest.raises(RequestError, match="between 1:4 and 4:1"):
        geometry.resolve_geometry(aspect_ratio="1:5")
    with pytest.raises(RequestError, match="seconds must be from 5 to 15"):
        geometry.resolve_geometry(seconds=2.0)
    with pytest.raises(RequestError, match="seconds must be from 5 to 15"):
        geometry.resolve_geometry(seconds=16)
    with pytest.raises(RequestError, match="124 to 345 frames"):
        geometry.resolve_geometry(num_frames=346)
    with pytest.raises(RequestError, match="multiple of 32"):
        geometry.resolve_geometry(height=100, width=96)
    with pytest.raises(RequestError, match="aspect_ratio must look like"):
        geometry.resolve_geometry(aspect_ratio="wide")
    assert geometry.resolve_geometry(height=64, width=96, num_frames=121).num_frames == 124
