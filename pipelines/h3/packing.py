"""The packed-sequence layout of MiniMax-H3 (docs/model.md, "The packed sequence").

t2va / fl2va: `[text | keyframe conditions | target audio (ch0 block, ch1 block) | target video]`.
ref2va: `[text | reference blocks in request order | target audio | target video]`, the references advancing a
rotary clock that the targets then start from.
Everything here is a pure function of the latent geometry, the text rows' tags and the keyframe anchors or
reference blocks, and reproduces diffusers' layout bit for bit (float64 positions built in the same operation order).
"""

from dataclasses import dataclass

import numpy as np
import torch

from h3gen.pipelines.h3.geometry import AUDIO_CHANNELS
from h3gen.pipelines.h3.transformer_config import AUDIO_TAG, TEXT_TAG, VIDEO_TAG

# One latent frame spans 5/3 * (1, 4, 4, 4, 4)[frame % 5] rotary units (a 17-frame VAE chunk gives 5 latents:
# the first covers 1 pixel frame, the others 4; 5/3 units per pixel frame = 40 units per second at 24 fps, the
# audio latent rate). Spatial axes are normalised by sqrt(latent area) and scaled to 32 units.
ROPE_FRAME_RESCALE = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32
KEYFRAME_ANCHORS = ("first", "last")


@dataclass
class PackedLayout:
    """Where every row of the packed sequence sits and what it is.

    position_ids: `(S, 3)` float64 (t, h, w) rotary coordinates. token_tags: `(S,)` long, 0 video / 1 text / 2 audio.
    video_indices: long, condition rows then target rows. audio_indices, text_indices: long.
    """

    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int
    rows_per_frame: int

    @property
    def sequence_length(self) -> int:
        return self.position_ids.shape[0]

    def to(self, device: torch.device | str) -> "PackedLayout":
        """The index tensors and tags on `device` (positions stay float64 wherever they go)."""

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device)

        return PackedLayout(
            move(self.position_ids),
            move(self.token_tags),
            move(self.video_indices),
            move(self.audio_indices),
            move(self.text_indices),
            self.num_condition_video_rows,
            self.num_condition_audio_rows,
            self.rows_per_frame,
        )


def patchify_video(latents: torch.Tensor, patch_size: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """`(B, C, F, H, W)` latents -> `(B * F/pt * H/ph * W/pw, C * pt * ph * pw)` rows, frame-major then row-major,
    channel-major inside a row."""
    pt, ph, pw = patch_size
    b, c, f, h, w = latents.shape
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latents of shape {tuple(latents.shape)} do not divide into patches {patch_size}.")
    rows = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return rows.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify_video(
    rows: torch.Tensor, num_frames: int, height: int, width: int, patch_size: tuple[int, int, int] = (1, 2, 2)
) -> torch.Tensor:
    """Inverse of `patchify_video` for one item: `(F/pt * H/ph * W/pw, C * pt*ph*pw)` -> `(1, C, F, H, W)`."""
    pt, ph, pw = patch_size
    channels = rows.shape[-1] // (pt * ph * pw)
    grid = rows.reshape(1, num_frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return grid.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, num_frames, height, width)


def spatial_axis(size: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """`size // patch` float64 coordinates of one spatial axis: centred, aspect-normalised, excluding the right end,
    times 32. Built with numpy's `linspace` (start + i * step), which `torch.linspace` does not reproduce."""
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    grid = np.linspace(left, left + ratio, size // patch, endpoint=False) * ROPE_SPATIAL_SCALE
    return torch.from_numpy(grid).to(torch.float64)


def frame_grid(latent_height: int, latent_width: int, patch_h: int, patch_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(rows_per_frame, 2)` float64 (h, w) coordinates of one latent frame, and its width axis."""
    sqrt_area = np.sqrt(latent_height * latent_width)
    heights = spatial_axis(latent_height, patch_h, sqrt_area)
    widths = spatial_axis(latent_width, patch_w, sqrt_area)
    hh, ww = torch.meshgrid(heights, widths, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), widths


def frame_times(num_latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of every latent frame from `origin`: origin + cumulative spans (sequential float64 sum)."""
    spans = torch.tensor(
        [
            ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[i % len(ROPE_FRAMES_PER_LATENT)]
            for i in range(num_latent_frames)
        ],
        dtype=torch.float64,
    )
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def last_keyframe_time(num_latent_frames: int, origin: float) -> float:
    """Rotary time of a keyframe anchored at the last frame. The reference sums the spans with numpy's pairwise
    summation here (not the sequential sum of `frame_times`); the two differ in the last ulp from 16 frames on."""
    spans = np.ones(num_latent_frames, dtype=np.float64) * ROPE_FRAME_RESCALE
    for offset, frames in enumerate(ROPE_FRAMES_PER_LATENT):
        spans[offset :: len(ROPE_FRAMES_PER_LATENT)] *= frames
    return origin + float(spans.sum()) - ROPE_FRAME_RESCALE


def build_layout(
    text_token_tags: torch.Tensor | int,
    num_latent_frames: int,
    latent_height: int,
    latent_width: int,
    num_audio_latents: int,
    *,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    keyframe_anchors: tuple[str, ...] = (),
    audio_channels: int = AUDIO_CHANNELS,
    media_offset: float = 0.0,
    guide_frames: int = 0,
    guide_audio_latents: int = 0,
) -> PackedLayout:
    """The t2va / fl2va layout `[text | keyframes | guide video | guide audio ch0, ch1 | audio ch0, ch1 | video]`.

    Args:
        text_token_tags: `(T,)` tags of the text rows (1, or 0 for rows of a keyframe's vision block), or T for
            plain text.
        num_latent_frames, latent_height, latent_width: target video latent grid.
        num_audio_latents: audio latents per channel.
        keyframe_anchors: one "first" / "last" per keyframe, in packed order.
        media_offset: rotary units added to the time of every media row (a window of a long clip sits on the
            clip's timeline); 0 for a plain request.
        guide_frames, guide_audio_latents: a long clip's guide (the previous window's tail): condition rows of
            that many latent frames and audio latents per channel on the target's own first positions. 0: none.
    """
    if isinstance(text_token_tags, int):
        text_token_tags = torch.full((text_token_tags,), TEXT_TAG, dtype=torch.long)
    _, patch_h, patch_w = patch_size
    rows_per_frame = (latent_height // patch_h) * (latent_width // patch_w)
    num_text = int(text_token_tags.shape[0])
    num_guide_video, num_guide_audio = guide_frames * rows_per_frame, guide_audio_latents * audio_channels
    num_condition = len(keyframe_anchors) * rows_per_frame + num_guide_video
    num_audio = num_audio_latents * audio_channels
    num_video = num_latent_frames * rows_per_frame
    seq_len = num_text + num_condition + num_guide_audio + num_audio + num_video
    condition_start, guide_audio_start = num_text, num_text + num_condition
    audio_start = guide_audio_start + num_guide_audio
    video_start = audio_start + num_audio
    origin = float(num_text) + media_offset  # media time starts after the text rows

    positions = torch.zeros(seq_len, 3, dtype=torch.float64)
    positions[:num_text, 0] = torch.arange(num_text, dtype=torch.float64)
    grid, widths = frame_grid(latent_height, latent_width, patch_h, patch_w)

    for index, anchor in enumerate(keyframe_anchors):
        if anchor not in KEYFRAME_ANCHORS:
            raise ValueError(f"a keyframe anchor must be 'first' or 'last', got {anchor!r}.")
        rows = slice(condition_start + index * rows_per_frame, condition_start + (index + 1) * rows_per_frame)
        positions[rows, 0] = origin if anchor == "first" else last_keyframe_time(num_latent_frames, origin)
        positions[rows, 1:] = grid
    if guide_frames:
        _fill_video(positions, guide_audio_start - num_guide_video, guide_frames, origin, grid)
    if guide_audio_latents:
        _fill_audio(positions, guide_audio_start, guide_audio_latents, origin, widths, audio_channels)

    # Audio: channel-major blocks on the video's clock (one unit per latent), no height, pinned to the two ends of
    # the width axis (left channel first).
    positions[audio_start:video_start, 0] = (origin + torch.arange(num_audio_latents, dtype=torch.float64)).repeat(
        audio_channels
    )
    positions[audio_start:video_start, 2] = torch.cat(
        [
            torch.full((num_audio_latents,), float(widths[0]), dtype=torch.float64),
            torch.full((num_audio - num_audio_latents,), float(widths[-1]), dtype=torch.float64),
        ]
    )

    video_positions = torch.empty(num_latent_frames, rows_per_frame, 3, dtype=torch.float64)
    video_positions[:, :, 0] = frame_times(num_latent_frames, origin)[:, None]
    video_positions[:, :, 1:] = grid[None]
    positions[video_start:] = video_positions.reshape(-1, 3)

    video_indices = torch.cat([torch.arange(condition_start, guide_audio_start), torch.arange(video_start, seq_len)])
    audio_indices = torch.arange(guide_audio_start, video_start)
    text_indices = torch.arange(num_text)
    tags = torch.empty(seq_len, dtype=torch.long)
    tags[text_indices] = text_token_tags.to(torch.long)
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(
        positions, tags, video_indices, audio_indices, text_indices, num_condition, num_guide_audio, rows_per_frame
    )


def row_timesteps(
    layout: PackedLayout,
    video_timestep: float,
    audio_timestep: float,
    condition_video_timestep: float,
    condition_audio_timestep: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row timesteps of one step reduced to the transformer's `(timestep (K,) float32 sorted, timestep_indices
    (S,) long)`. Text rows inherit the video timestep; conditioning rows sit at their own level."""
    t = torch.full((layout.sequence_length,), video_timestep, dtype=torch.float32)
    t[layout.video_indices[: layout.num_condition_video_rows]] = condition_video_timestep
    t[layout.audio_indices[layout.num_condition_audio_rows :]] = audio_timestep
    t[layout.audio_indices[: layout.num_condition_audio_rows]] = condition_audio_timestep
    return torch.unique(t, sorted=True, return_inverse=True)


@dataclass(frozen=True)
class ReferenceBlock:
    """The rows one ref2va reference occupies: `kind` "image" / "video" / "audio", its latent grid (frames, height,
    width; zeros for audio) and its audio latents per channel (0 without sound)."""

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0


def _fill_audio(
    positions: torch.Tensor, start: int, num_latents: int, origin: float, widths: torch.Tensor, channels: int
) -> None:
    """One channel-major audio block: time origin + j, no height, pinned to the ends of `widths` (left channel on
    the first coordinate, the other on the last)."""
    stop = start + num_latents * channels
    positions[start:stop, 0] = (origin + torch.arange(num_latents, dtype=torch.float64)).repeat(channels)
    positions[start:stop, 2] = torch.cat(
        [
            torch.full((num_latents,), float(widths[0]), dtype=torch.float64),
            torch.full((num_latents * (channels - 1),), float(widths[-1]), dtype=torch.float64),
        ]
    )


def _fill_video(positions: torch.Tensor, start: int, num_frames: int, origin: float, grid: torch.Tensor) -> int:
    """Frame-major video rows from `start`: each frame's time, then its (h, w) grid. Returns the end row."""
    stop = start + num_frames * grid.shape[0]
    block = positions[start:stop].view(num_frames, grid.shape[0], 3)
    block[:, :, 0] = frame_times(num_frames, origin)[:, None]
    block[:, :, 1:] = grid[None]
    return stop


def build_ref2va_layout(
    text_token_tags: torch.Tensor,
    references: list[ReferenceBlock],
    num_latent_frames: int,
    latent_height: int,
    latent_width: int,
    num_audio_latents: int,
    *,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    audio_channels: int = AUDIO_CHANNELS,
    media_offset: float = 0.0,
    guide_frames: int = 0,
    guide_audio_latents: int = 0,
) -> PackedLayout:
    """The ref2va layout `[text | references | audio ch0, ch1 | video]` (diffusers 0.42.1
    modular_pipelines/minimax_h3/before_denoise.py:566-730, `build_ref2va_packed_sequence`).

    The rotary clock starts at the text length. An image reference sits on its own latent grid at the clock and
    advances it by one; an audio reference is a channel-major block on the target's width ends and advances it by its
    latent count; a video reference puts its soundtrack rows (on its own width ends) right before its video rows,
    both from the clock, and advances it by the longer of the two. The targets start where the clock stops.
    `video_indices` / `audio_indices` list reference rows first, in order, then the target rows.

    A window of a long clip adds `media_offset` rotary units to the targets' start (the references stay where
    they are), and its guide (`guide_frames` latent frames, `guide_audio_latents` per channel: the previous
    window's tail) follows the references as one more block, audio then video, on the targets' own first positions
    without advancing the clock.
    """
    _, patch_h, patch_w = patch_size
    num_text = int(text_token_tags.shape[0])

    def rows_per_frame(height: int, width: int) -> int:
        return (height // patch_h) * (width // patch_w)

    reference_video = sum(
        r.latent_frames * rows_per_frame(r.latent_height, r.latent_width) for r in references if r.kind != "audio"
    )
    reference_audio = sum(r.audio_latents * audio_channels for r in references)
    target_rows = rows_per_frame(latent_height, latent_width)
    reference_video += guide_frames * target_rows
    reference_audio += guide_audio_latents * audio_channels
    seq_len = (
        num_text
        + reference_video
        + reference_audio
        + num_audio_latents * audio_channels
        + num_latent_frames * target_rows
    )

    positions = torch.zeros(seq_len, 3, dtype=torch.float64)
    positions[:num_text, 0] = torch.arange(num_text, dtype=torch.float64)
    target_grid, target_widths = frame_grid(latent_height, latent_width, patch_h, patch_w)
    video_indices, audio_indices = [], []
    cursor, clock = num_text, float(num_text)
    for reference in references:
        if reference.kind == "audio":
            _fill_audio(positions, cursor, reference.audio_latents, clock, target_widths, audio_channels)
            audio_indices.append(torch.arange(cursor, cursor + reference.audio_latents * audio_channels))
            cursor += reference.audio_latents * audio_channels
            clock += float(reference.audio_latents)
            continue
        if reference.kind not in ("image", "video"):
            raise ValueError(f"a reference block is 'image', 'video' or 'audio', got {reference.kind!r}.")
        grid, widths = frame_grid(reference.latent_height, reference.latent_width, patch_h, patch_w)
        if reference.audio_latents:
            _fill_audio(positions, cursor, reference.audio_latents, clock, widths, audio_channels)
            audio_indices.append(torch.arange(cursor, cursor + reference.audio_latents * audio_channels))
            cursor += reference.audio_latents * audio_channels
        start = cursor
        cursor = _fill_video(positions, cursor, reference.latent_frames, clock, grid)
        video_indices.append(torch.arange(start, cursor))
        if reference.kind == "image":
            clock += 1.0  # a single frame takes one integer slot, not a latent frame's span
        else:
            # Summed one span at a time in float64, as the reference does here (not the pairwise sum of
            # `last_keyframe_time`): the two differ in the last ulp from 16 latent frames on.
            span = sum(
                ROPE_FRAME_RESCALE * ROPE_FRAMES_PER_LATENT[i % len(ROPE_FRAMES_PER_LATENT)]
                for i in range(reference.latent_frames)
            )
            clock += max(float(reference.audio_latents), span)

    clock += media_offset
    if guide_audio_latents:
        _fill_audio(positions, cursor, guide_audio_latents, clock, target_widths, audio_channels)
        audio_indices.append(torch.arange(cursor, cursor + guide_audio_latents * audio_channels))
        cursor += guide_audio_latents * audio_channels
    if guide_frames:
        start = cursor
        cursor = _fill_video(positions, cursor, guide_frames, clock, target_grid)
        video_indices.append(torch.arange(start, cursor))
    audio_start = cursor
    _fill_audio(positions, audio_start, num_audio_latents, clock, target_widths, audio_channels)
    video_start = audio_start + num_audio_latents * audio_channels
    _fill_video(positions, video_start, num_latent_frames, clock, target_grid)

    video_indices = torch.cat(video_indices + [torch.arange(video_start, seq_len)])
    audio_indices = torch.cat(audio_indices + [torch.arange(audio_start, video_start)])
    text_indices = torch.arange(num_text)
    tags = torch.empty(seq_len, dtype=torch.long)
    tags[text_indices] = text_token_tags.to(torch.long)
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return PackedLayout(
        positions, tags, video_indices, audio_indices, text_indices, reference_video, reference_audio, target_rows
    )
