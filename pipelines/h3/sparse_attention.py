"""Sparse attention per request: which forwards run VSA-H3 at which sparsity, and the tile geometry of a packed
sequence.

A request's `sparsity` is the fraction of video key tiles each pure-video query tile drops: one number for every
forward, one per forward, or "default"; `dense_forwards` runs the first forwards dense. Text, condition and audio
query rows always attend densely and every key of theirs is kept (VSA-H3's tiles never mix segments), which SGLang
found keeps the audio intact (SGLang #35850: the last second's audio correlation 0.568 -> 0.815 once sparsity was
limited to video queries).

"default" is the training-free schedule for the base model: 0.75 after the first fifth of the forwards ran dense
(10 of 49), SGLang's SubBlock defaults (sparsity 0.75, `skip_first_steps` 10; 1.14-1.22x on the denoise at 5 s,
SSIM 0.80 against lossless on 8 x H200). A VSA student runs its contract's sparsity (0.9) on every forward unless the
request says otherwise.
"""

import math
from numbers import Real

import torch

from h3gen.errors import RequestError
from h3gen.kernels.vsa_h3 import TileGeometry, build_tile_geometry
from h3gen.pipelines.h3.packing import PackedLayout

DEFAULT_SPARSITY = 0.75
DEFAULT_DENSE_FRACTION = 10 / 49


def resolve_sparsity(sparsity, dense_forwards, forwards: int, contract: float | None = None) -> tuple | None:
    """One sparsity per forward (a tuple of `forwards` floats in [0, 1)), or None for dense attention throughout.

    Args:
        sparsity: None (the model's own: `contract` for a VSA student, else dense), a number in [0, 1), a sequence of
            `forwards` numbers, or "default" (`DEFAULT_SPARSITY` after `DEFAULT_DENSE_FRACTION` of the forwards).
        dense_forwards: None, or how many of the first forwards run dense (0 to `forwards`).
        forwards: the request's transformer forwards.
        contract: a VSA student's sparsity (its gates need the tile geometry on every forward), or None.
    Raises `RequestError` naming the field."""
    if dense_forwards is not None and (
        isinstance(dense_forwards, bool) or not isinstance(dense_forwards, int) or not 0 <= dense_forwards <= forwards
    ):
        raise RequestError(
            f"dense_forwards must be an integer from 0 to the request's {forwards} forwards (got {dense_forwards!r}).",
            "dense_forwards",
        )
    if sparsity is None:
        if contract is None:
            if dense_forwards:
                raise RequestError('dense_forwards needs sparsity (a number, a list or "default").', "dense_forwards")
            return None
        sparsity = contract
    if sparsity == "default":
        schedule = [DEFAULT_SPARSITY] * forwards
        first = math.ceil(DEFAULT_DENSE_FRACTION * forwards) if dense_forwards is None else dense_forwards
    elif isinstance(sparsity, str):
        raise RequestError(
            f'sparsity must be a number in [0, 1), a list of them or "default" (got {sparsity!r}).', "sparsity"
        )
    elif isinstance(sparsity, (list, tuple)):
        if len(sparsity) != forwards:
            raise RequestError(
                f"sparsity lists one value per transformer forward: this request runs {forwards}, the list has "
                f"{len(sparsity)}.",
                "sparsity",
            )
        schedule, first = [_one(value) for value in sparsity], dense_forwards or 0
    else:
        schedule, first = [_one(sparsity)] * forwards, dense_forwards or 0
    return tuple(0.0 if index < first else value for index, value in enumerate(schedule))


def _one(value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not 0 <= value < 1:
        raise RequestError(
            f"sparsity is the fraction of video tiles dropped: a number in [0, 1) (got {value!r}).",
            "sparsity",
        )
    return float(value)


def packed_geometry(
    layout: PackedLayout, num_condition_video: int, num_condition_audio: int, grid: tuple[int, int, int]
) -> TileGeometry:
    """The VSA-H3 tile geometry of one packed sequence: prefix segments text, conditions (keyframe or reference rows
    and their sound) and the target audio, then the target video on its post-patch `grid` (t, h, w).

    Raises `ValueError` when the layout is not `[text | conditions | audio | video]` with the video rows in
    row-major grid order (what VSA-H3's tiles assume)."""
    rows = layout.sequence_length
    text = layout.text_indices.numel()
    video = layout.video_indices[num_condition_video:]
    audio = layout.audio_indices[num_condition_audio:]
    video_start, audio_start = rows - video.numel(), rows - video.numel() - audio.numel()
    contiguous = (
        torch.equal(layout.text_indices.cpu(), torch.arange(text))
        and torch.equal(audio.cpu(), torch.arange(audio_start, video_start))
        and torch.equal(video.cpu(), torch.arange(video_start, rows))
        and video.numel() == grid[0] * grid[1] * grid[2]
    )
    if not contiguous:
        raise ValueError("sparse attention needs the packed layout [text | conditions | audio | video].")
    return build_tile_geometry((text, audio_start - text, audio.numel()), grid, rows)
