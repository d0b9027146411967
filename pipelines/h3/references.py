"""The references of a ref2va request: what a caller passes, how it is checked, and how it is normalized.

ref2va conditions on an ordered list of references (docs/model.md, "ref2va"): images (subject, style, scene), videos
(motion and camera, with their soundtrack) and audio clips (voice, music). The order matters twice: it numbers the
`<Picture i>` / `<Video k>` / `<Audio j>` labels of the prompt and it advances the rotary clock the reference blocks
share, so a different order is a different request.

Normalization is diffusers 0.42.1's (modular_pipelines/minimax_h3/before_encoder.py:167-522,
`MiniMaxH3Ref2VASetupStep`), so the conditioning is identical:
  - an image is resized (LANCZOS) to its own short edge (2048 for the released checkpoint; no area cap), both
    sides rounded to 32;
  - a video is put on 24 fps by dropping and repeating whole frames, truncated to the generated frame count and
    resized (LANCZOS) onto the canvas its own aspect ratio resolves to;
  - sound (an audio reference or a video's soundtrack) is truncated to the generated length at its own rate, made
    stereo and resampled to 32 kHz (windowed-sinc, the same filter as torchaudio's `Resample`).
Files are decoded with PyAV only as far as the request needs, so a long clip costs no more than a short one.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from PIL import Image

from h3gen.errors import RequestError
from h3gen.media import check_audio_rate, iter_video_frames, probe_video, read_audio, read_image, resample_stream
from h3gen.pipelines.h3 import geometry

MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_REFERENCES = 9, 3, 3, 12
REFERENCE_IMAGE_SHORT_EDGE = 2048
AUDIO_SAMPLE_RATE = 32000
AUDIO_HOP = 800  # audio VAE samples per latent
VIDEO_SAMPLE_FPS = 2.0  # the text encoder reads a reference video at 2 fps ...
VISION_TEMPORAL_PATCH = 2  # ... and merges its sampled frames in pairs
# So a video reference needs at least two sampled frames: 13 frames at 24 fps.
MIN_VIDEO_FRAMES = round((VISION_TEMPORAL_PATCH - 1) * geometry.FPS / VIDEO_SAMPLE_FPS) + 1

KINDS = ("image", "video", "audio")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".ts"}
AUDIO_SUFFIXES = {".wav", ".mp3", ".m4a", ".aac", ".flac", ".ogg", ".opus", ".oga"}


@dataclass
class ImageReference:
    """A subject, style or scene reference (at most 9 per request).

    `image`: a path, a PIL image, an `(H, W, 3)` array (uint8, or float in [0, 1]) or a `(3, H, W)` tensor. It never
    sets the generated canvas: it is encoded at a short edge of its own. `name` is what errors call it (e.g. the CLI
    flag); default `references[i]`.
    """

    image: object
    name: str | None = None
    kind = "image"


@dataclass
class VideoReference:
    """A motion and camera reference (at most 3 per request), conditioned on together with its soundtrack.

    `video`: a path, or frames: an `(F, H, W, 3)` array (uint8, or float in [0, 1]), an `(F, 3, H, W)` tensor or a
    list of PIL images. `fps`: the rate of the frames (default: the file's own, or 24 for frames); it is what puts the
    reference on the model's 24 fps clock, so get it right. `audio` `(channels, samples)` at `sample_rate` (default
    32000): a soundtrack for in-memory frames, or one that replaces a file's. `soundtrack=False` ignores a file's own
    soundtrack (motion only).
    """

    video: object
    fps: float | None = None
    audio: object = None
    sample_rate: int | None = None
    soundtrack: bool = True
    name: str | None = None
    kind = "video"


@dataclass
class AudioReference:
    """A voice or music reference (at most 3 per request, and never the only kind: pair it with an image or video).

    `audio`: a path (wav, mp3, m4a, ... or a video whose soundtrack is taken) or a `(channels, samples)` / `(samples,)`
    waveform in [-1, 1] at `sample_rate` (default 32000), mono or stereo.
    """

    audio: object
    sample_rate: int | None = None
    name: str | None = None
    kind = "audio"


Reference = ImageReference | VideoReference | AudioReference


@dataclass
class PreparedReference:
    """One normalized reference, ready to encode. `image`: RGB PIL at its own size (image references); `frames`:
    `(F, H, W, 3)` uint8 at 24 fps on its canvas (video references); `audio`: `(2, N)` float32 at 32 kHz, or None."""

    kind: str
    name: str
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    audio: torch.Tensor | None = None

    @property
    def has_audio(self) -> bool:
        return self.audio is not None

    @property
    def visual_size(self) -> tuple[int, int]:
        """(height, width) in pixels of the image or of the video frames."""
        if self.image is not None:
            return self.image.size[1], self.image.size[0]
        return self.frames.shape[1], self.frames.shape[2]

    @property
    def num_encoded_frames(self) -> int:
        """Pixel frames the video VAE encodes: an image is one; a video is snapped down to 17n + 5 (never past its
        own length, which the VAE pads up to its next 17-frame chunk)."""
        if self.kind == "image":
            return 1
        frames = self.frames.shape[0]
        snapped = max(1, (frames - geometry.LATENTS_PER_CHUNK) // geometry.FRAMES_PER_CHUNK)
        return min(frames, snapped * geometry.FRAMES_PER_CHUNK + geometry.LATENTS_PER_CHUNK)

    @property
    def num_latent_frames(self) -> int:
        """Latent frames the video VAE gives: 1 for one frame; 5 per started 17-frame chunk, less 3 dropped."""
        frames = self.num_encoded_frames
        if frames == 1:
            return 1
        return math.ceil(frames / geometry.FRAMES_PER_CHUNK) * geometry.LATENTS_PER_CHUNK - 3

    @property
    def num_audio_latents(self) -> int:
        """Audio latents per channel (the audio VAE pads to a whole hop)."""
        return math.ceil(self.audio.shape[-1] / AUDIO_HOP) if self.audio is not None else 0


# ---------------------------------------------------------------------------------------------- what was passed


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


def reference_kind(path, name: str = "references") -> str:
    """ "image", "video" or "audio" for a media file: by its suffix, else by what it decodes as."""
    import av  # PyAV loads FFmpeg's libraries: imported where a file is probed, as in h3gen.media

    path = Path(path)
    suffix = path.suffix.lower()
    for kind, suffixes in (("image", IMAGE_SUFFIXES), ("video", VIDEO_SUFFIXES), ("audio", AUDIO_SUFFIXES)):
        if suffix in suffixes:
            return kind
    if not path.is_file():
        raise RequestError(f"{name} file {path.name} does not exist.", name)
    try:
        with Image.open(path) as image:
            image.verify()
        return "image"
    except Exception:  # not an image: ask FFmpeg
        pass
    try:
        with av.open(str(path)) as container:
            if container.streams.video:
                return "video"
            if container.streams.audio:
                return "audio"
    except (av.error.FFmpegError, OSError, ValueError):
        pass
    raise RequestError(f"{name} file {path.name} is neither an image, a video nor an audio file.", name)


def as_reference(item, name: str) -> Reference:
    """A reference object from what a caller passed: a reference object, a PIL image, or a file path (kind
    by suffix or content). Anything else is ambiguous and raises `RequestError`."""
    if isinstance(item, (ImageReference, VideoReference, AudioReference)):
        return item if item.name else type(item)(**{**item.__dict__, "name": name})
    if isinstance(item, Image.Image):
        return ImageReference(item, name=name)
    if _is_path(item):
        kind = reference_kind(item, name)
        return {"image": ImageReference, "video": VideoReference, "audio": AudioReference}[kind](item, name=name)
    raise RequestError(
        f"{name} must be a file path, a PIL image, or an ImageReference / VideoReference / AudioReference (got "
        f"{type(item).__name__}; arrays need one of those types, which say what they hold).",
        name,
    )


def as_references(references) -> list[Reference]:
    """Check the list and its counts (at most 9 images, 3 videos, 3 audios, 12 in all; audio never alone)."""
    if isinstance(references, (str, os.PathLike)) or not isinstance(references, (list, tuple)):
        raise RequestError("references must be a list of references (paths or reference objects).", "references")
    if not references:
        raise RequestError("ref2va needs at least one reference (an image, a video or an audio clip).", "references")
    items = [as_reference(item, f"references[{index}]") for index, item in enumerate(references)]
    if len(items) > MAX_REFERENCES:
        name = items[MAX_REFERENCES].name
        raise RequestError(f"{name}: at most {MAX_REFERENCES} references in all (got {len(items)}).", name)
    for kind, limit in (("image", MAX_IMAGES), ("video", MAX_VIDEOS), ("audio", MAX_AUDIOS)):
        of_kind = [item for item in items if item.kind == kind]
        if len(of_kind) > limit:
            name = of_kind[limit].name
            raise RequestError(f"{name}: at most {limit} {kind} references (got {len(of_kind)}).", name)
    if all(item.kind == "audio" for item in items):
        raise RequestError(
            f"{items[0].name}: an audio reference needs at least one image or video reference beside "
            "it; audio cannot be the only reference.",
            items[0].name,
        )
    return items


# ---------------------------------------------------------------------------------------------- sound


MAX_FILTER_TAPS = 1 << 22  # 32 MB of float64 filter; 44.1 kHz -> 32 kHz needs 146,880 values


def resample_audio(waveform: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """Band-limited (windowed-sinc, Hann window, 6 zero crossings, rolloff 0.99) resampling along the last axis:
    torchaudio's `Resample` filter, computed in float64 and applied in float32 with the same arithmetic, so the
    result equals it. Output length ceil(N * new / orig).

    The filter has `new / gcd` phases of `orig / gcd` taps: a few thousand values for the rates sound comes in
    (44.1, 48, 16 kHz ...), but billions for two rates with a small common divisor (44101 -> 32000 Hz). Past
    `MAX_FILTER_TAPS`, libswresample resamples instead (`h3gen.media.resample_stream`, bounded memory), to the
    same length."""
    if orig_rate == new_rate:
        return waveform
    zero_crossings, rolloff = 6, 0.99
    gcd = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // gcd, int(new_rate) // gcd
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / cutoff)
    length = math.ceil(new * waveform.shape[-1] / orig)
    if new * (2 * width + orig) > MAX_FILTER_TAPS:
        flat = waveform.reshape(-1, waveform.shape[-1]).to(torch.float32).numpy()
        out = np.concatenate([resample_stream(row[None], int(orig_rate), int(new_rate)) for row in flat])
        out = np.pad(out[:, :length], ((0, 0), (0, max(0, length - out.shape[-1]))))
        return torch.from_numpy(out).reshape(*waveform.shape[:-1], -1)
    # Filter taps for the `new` output phases: t[phase, tap] = (tap - width) / orig - phase / new, in cutoff units.
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phases = torch.arange(0, -new, -1)[:, None, None] / new  # float32, as the reference computes it
    t = ((phases + taps) * cutoff).clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t) * (window * (cutoff / orig))
    kernel = kernel.to(torch.float32)

    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    padded = torch.nn.functional.pad(flat, (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig).transpose(1, 2).reshape(flat.shape[0], -1)
    return out[:, :length].reshape(*shape[:-1], -1)


def _as_waveform(audio, name: str) -> torch.Tensor:
    waveform = torch.as_tensor(np.asarray(audio) if not isinstance(audio, torch.Tensor) else audio)
    if waveform.ndim == 1:
        waveform = waveform[None]
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2) or waveform.shape[1] == 0:
        raise RequestError(
            f"{name} audio must be a mono or stereo (channels, samples) waveform (got shape {tuple(waveform.shape)}).",
            name,
        )
    if not waveform.is_floating_point():
        raise RequestError(f"{name} audio must be float samples in [-1, 1] (got {waveform.dtype}).", name)
    return waveform.to(torch.float32)


def normalize_audio(waveform: torch.Tensor, sample_rate: int, num_frames: int) -> torch.Tensor:
    """Truncate to the generated length at its own rate, make stereo, resample to 32 kHz (diffusers 0.42.1
    before_encoder.py:347-385, `_normalize_audio_condition`)."""
    waveform = waveform[:, : int(num_frames / geometry.FPS * sample_rate)]
    if waveform.shape[0] != 2:
        waveform = waveform.expand(2, -1).contiguous()
    return resample_audio(waveform, sample_rate, AUDIO_SAMPLE_RATE)


def sound_of(reference: Reference, num_frames: int | None = None) -> tuple[torch.Tensor, int] | None:
    """A reference's raw sound `(channels, samples)` float32 and its rate, or None when it carries none. With
    `num_frames`, a file is decoded only as far as that many frames at 24 fps need."""
    if reference.kind == "image":
        return None
    source = reference.audio
    if reference.kind == "video" and source is None:
        if not (reference.soundtrack and _is_path(reference.video)):
            return None
        if not probe_video(reference.video, reference.name).has_audio:
            return None
        source = reference.video
    if _is_path(source):
        # Decode only what the truncation to `num_frames` keeps (all of it when the caller overrides the rate).
        seconds = None if num_frames is None or reference.sample_rate is not None else num_frames / geometry.FPS
        waveform, rate = read_audio(source, reference.name, max_seconds=seconds)
        if reference.sample_rate is not None:  # the caller corrects a file whose metadata is wrong
            rate = check_audio_rate(reference.sample_rate, reference.name)
        return torch.from_numpy(waveform), rate
    rate = (
        AUDIO_SAMPLE_RATE if reference.sample_rate is None else check_audio_rate(reference.sample_rate, reference.name)
    )
    return _as_waveform(source, reference.name), rate


def sound_seconds(references: list[Reference]) -> tuple[float, str] | None:
    """The length of the first reference that carries sound, and its name (None without any): how long a ref2va
    request runs when it does not say."""
    for reference in references:
        sound = sound_of(reference)
        if sound is not None:
            return sound[0].shape[-1] / sound[1], reference.name
    return None


# ---------------------------------------------------------------------------------------------- pictures


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    if pixels.dtype == np.uint8:
        return pixels
    if not np.issubdtype(pixels.dtype, np.floating):
        raise ValueError(f"pixels must be uint8 or float in [0, 1] (got {pixels.dtype})")
    return (pixels * 255.0).round().clip(0, 255).astype(np.uint8)


def _check_aspect(width: int, height: int, name: str) -> None:
    if width <= 0 or height <= 0 or width > 4 * height or height > 4 * width:
        raise RequestError(f"{name} must have an aspect ratio between 1:4 and 4:1 (got {width}x{height}).", name)


def load_image(source, name: str) -> Image.Image:
    """An image reference as an RGB PIL image, from a path, PIL image, `(H, W, 3)` array or `(3, H, W)` tensor."""
    if isinstance(source, torch.Tensor):
        if source.ndim != 3 or source.shape[0] != 3:
            raise RequestError(f"{name} tensor must be (3, height, width) (got {tuple(source.shape)}).", name)
        pixels = source.float().div(255.0) if source.dtype == torch.uint8 else source.float()
        source = pixels.permute(1, 2, 0).cpu().numpy()
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] != 3:
            raise RequestError(f"{name} array must be (height, width, 3) RGB (got {source.shape}).", name)
        try:
            return Image.fromarray(_to_uint8(source))
        except ValueError as error:
            raise RequestError(f"{name}: {error}.", name) from None
    return read_image(source, name)


def normalize_image(image: Image.Image, *, short_edge: int, multiple: int, name: str) -> Image.Image:
    """Resize to `short_edge` on the short side (up or down, no area cap), both sides rounded to `multiple`."""
    width, height = image.size
    _check_aspect(width, height, name)
    scale = short_edge / min(width, height)
    size = (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def _frames_of(video, name: str) -> Iterable[np.ndarray]:
    """Frames of an in-memory video, one `(H, W, 3)` uint8 at a time."""
    if isinstance(video, torch.Tensor):
        if video.ndim != 4 or video.shape[1] != 3:
            raise RequestError(f"{name} tensor must be (frames, 3, height, width) (got {tuple(video.shape)}).", name)
        video = video.movedim(1, -1).cpu().numpy()
    if isinstance(video, (list, tuple)):
        frames = [
            np.asarray(frame.convert("RGB")) if isinstance(frame, Image.Image) else np.asarray(frame) for frame in video
        ]
    else:
        frames = np.asarray(video)
        if frames.ndim != 4:
            raise RequestError(f"{name} frames must be (frames, height, width, 3) (got {frames.shape}).", name)
    for frame in frames:
        if frame.ndim != 3 or frame.shape[2] != 3:
            raise RequestError(f"{name} frames must be (height, width, 3) RGB (got {frame.shape}).", name)
        try:
            yield _to_uint8(frame)
        except ValueError as error:
            raise RequestError(f"{name}: {error}.", name) from None


def normalize_video(
    frames: Iterable[np.ndarray],
    fps: float,
    num_frames: int,
    *,
    multiple: int,
    short_edge: int,
    max_pixels: int,
    name: str,
) -> np.ndarray:
    """Put frames on 24 fps (each held until the slot of the next: floor(i * 24 / fps + 0.5)), keep the first
    `num_frames`, and resize them (LANCZOS) onto the canvas of their own aspect ratio. Stops reading `frames` as soon
    as it has enough, which is what keeps a long file cheap."""
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise RequestError(f"{name} fps must be a positive number (got {fps!r}).", name)
    scale = geometry.FPS / float(fps)
    out, size = [], None
    for index, frame in enumerate(frames):
        if size is None:
            _check_aspect(frame.shape[1], frame.shape[0], name)
            height, width = geometry.resolve_canvas(
                frame.shape[1], frame.shape[0], multiple=multiple, short_edge=short_edge, max_pixels=max_pixels
            )
            size = (frame.shape[0], frame.shape[1])
        elif frame.shape[:2] != size:
            raise RequestError(f"{name} frames must all have one size (got {frame.shape[:2]} after {size}).", name)
        if frame.shape[:2] != (height, width):
            frame = np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))
        repeats = math.floor((index + 1) * scale + 0.5) - math.floor(index * scale + 0.5)
        out += [frame] * repeats
        if len(out) >= num_frames:
            break
    out = out[:num_frames]
    if len(out) < MIN_VIDEO_FRAMES:
        raise RequestError(
            f"{name} is too short: the model reads a reference video at {VIDEO_SAMPLE_FPS:g} fps in pairs of frames, "
            f"so it needs at least {MIN_VIDEO_FRAMES} frames at 24 fps ({MIN_VIDEO_FRAMES / geometry.FPS:.2f} s; "
            f"got {len(out)}).",
            name,
        )
    return np.stack(out)


# ---------------------------------------------------------------------------------------------- the whole list


def prepare_references(
    references: list[Reference],
    num_frames: int,
    *,
    multiple: int,
    short_edge: int,
    max_pixels: int,
    image_short_edge: int = REFERENCE_IMAGE_SHORT_EDGE,
) -> list[PreparedReference]:
    """Decode and normalize every reference for a request of `num_frames` frames (17n + 5), in order."""
    prepared = []
    for reference in references:
        name = reference.name
        sound = sound_of(reference, num_frames)
        audio = normalize_audio(*sound, num_frames) if sound is not None else None
        if reference.kind == "image":
            image = normalize_image(
                load_image(reference.image, name), short_edge=image_short_edge, multiple=multiple, name=name
            )
            prepared.append(PreparedReference("image", name, image=image))
        elif reference.kind == "video":
            if _is_path(reference.video):
                info = probe_video(reference.video, name)
                fps = reference.fps or info.fps
                needed = math.ceil(num_frames * fps / geometry.FPS) + 2
                frames = iter_video_frames(reference.video, name, max_frames=needed)
            else:
                fps = reference.fps or geometry.FPS
                frames = _frames_of(reference.video, name)
            frames = normalize_video(
                frames, fps, num_frames, multiple=multiple, short_edge=short_edge, max_pixels=max_pixels, name=name
            )
            prepared.append(PreparedReference("video", name, frames=frames, audio=audio))
        else:
            prepared.append(PreparedReference("audio", name, audio=audio))
    return prepared
