"""Request geometry of MiniMax-H3: canvas size, frame alignment and latent counts (docs/model.md,
"Request geometry").

Every check raises `RequestError` naming the value and the allowed range, before any model work.
"""

from dataclasses import dataclass

from h3gen.errors import RequestError

FPS = 24
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
AUDIO_LATENTS_PER_SECOND = 40  # 32 kHz audio, hop 800
AUDIO_CHANNELS = 2  # stereo, packed channel-major
FRAMES_PER_CHUNK = 17  # video VAE clip_length
LATENTS_PER_CHUNK = 5  # video VAE latents kept per chunk
SPATIAL_COMPRESSION = 16
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
MAX_FRAMES = 345  # longest 17n + 5 count within 15 s


def parse_aspect_ratio(aspect: str) -> tuple[float, float]:
    """ "16:9" -> (16.0, 9.0). Raises `RequestError` for anything else."""
    try:
        width, height = (float(part) for part in str(aspect).split(":"))
    except ValueError:
        raise RequestError(f"aspect_ratio must look like 16:9 (got {aspect!r}).", "aspect_ratio") from None
    if not (width > 0 and height > 0):
        raise RequestError(f"aspect_ratio must have positive sides (got {aspect!r}).", "aspect_ratio")
    return width, height


def resolve_canvas(
    aspect_width: float,
    aspect_height: float,
    multiple: int = 32,
    short_edge: int = CANVAS_SHORT_EDGE,
    max_pixels: int = CANVAS_MAX_PIXELS,
) -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio: short edge `short_edge`, area capped at `max_pixels`, both
    sides rounded to the nearest `multiple` (so the area may end slightly above the cap), the result again within
    [1:4, 4:1], so an explicit `height`/`width` of it passes `resolve_geometry`. Ratio in [1:4, 4:1]."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise RequestError(f"aspect ratio must be positive (got {aspect_width:g}:{aspect_height:g}).", "aspect_ratio")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise RequestError(
            f"aspect ratio must be between 1:4 and 4:1 (got {aspect_width:g}:{aspect_height:g}).", "aspect_ratio"
        )
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    if width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
        width, height = width * scale, height * scale
    height, width = (
        max(multiple, round(height / multiple) * multiple),
        max(multiple, round(width / multiple) * multiple),
    )
    # Rounding a small canvas can push it past the ratio bounds (4:1 at a 32-pixel short edge rounds to 160x32 = 5:1),
    # which the model's explicit-size check refuses: bring the long side back within 4x the short one.
    longest = int(MAX_ASPECT * min(height, width)) // multiple * multiple
    return min(height, longest), min(width, longest)


def align_num_frames(num_frames: int) -> int:
    """Snap a frame count up to the next 17n + 5 the video VAE can encode."""
    if num_frames < 1:
        raise RequestError(f"num_frames must be positive (got {num_frames}).", "num_frames")
    while num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        num_frames += 1
    return num_frames


def check_duration(num_frames: int, field: str = "num_frames") -> None:
    """The aligned frame count must last 5-15 s at 24 fps, i.e. 124-345 frames (17n + 5, n = 7..20)."""
    seconds = num_frames / FPS
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise RequestError(
            f"{field} must be from 124 to 345 frames, {MIN_SECONDS:g} to {MAX_SECONDS:g} s at {FPS} fps after rounding "
            f"up to 17n+5 (got {num_frames} frames = {seconds:.3g} s).",
            field,
        )


def video_latent_frames(num_frames: int) -> int:
    """Latent frames for an aligned 17n + 5 frame count: 5n + 2."""
    if num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise RequestError(f"num_frames must be of the form 17n+5 (got {num_frames}).", "num_frames")
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latent_frames(num_frames: int) -> int:
    """Audio latents per channel covering `num_frames` video frames (40 per second, rounded)."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


@dataclass(frozen=True)
class Geometry:
    """The resolved shape of one request."""

    height: int  # pixels, multiple of the canvas multiple
    width: int
    num_frames: int  # 17n + 5
    num_latent_frames: int  # 5n + 2
    latent_height: int  # height / 16
    latent_width: int
    num_audio_latents: int  # per channel

    @property
    def seconds(self) -> float:
        return self.num_frames / FPS


def resolve_geometry(
    *,
    aspect_ratio: str | tuple[float, float] = "16:9",
    seconds: float | None = 5.0,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    multiple: int = 32,
    short_edge: int = CANVAS_SHORT_EDGE,
    max_pixels: int = CANVAS_MAX_PIXELS,
) -> Geometry:
    """Resolve a request's canvas and length. `num_frames` wins over `seconds` (frames = round(seconds * 24)); the
    count is snapped up to 17n + 5 and must then last 5-15 s. Explicit `height`/`width` (both or neither) override
    the canvas and must be multiples of `multiple` with an aspect within 1:4 .. 4:1."""
    if (height is None) != (width is None):
        raise RequestError("height and width must be given together, or neither.", "height")
    if height is None:
        aspect = parse_aspect_ratio(aspect_ratio) if isinstance(aspect_ratio, str) else aspect_ratio
        height, width = resolve_canvas(*aspect, multiple=multiple, short_edge=short_edge, max_pixels=max_pixels)
    else:
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value < multiple or value % multiple:
                raise RequestError(f"{name} must be a positive multiple of {multiple} (got {value}).", name)
        if not MIN_ASPECT <= width / height <= MAX_ASPECT:
            raise RequestError(f"width:height must be between 1:4 and 4:1 (got {width}x{height}).", "width")
    if num_frames is None:
        if seconds is None:
            raise RequestError("give seconds or num_frames.", "seconds")
        if not (isinstance(seconds, (int, float)) and MIN_SECONDS <= seconds <= MAX_SECONDS):
            raise RequestError(f"seconds must be from {MIN_SECONDS:g} to {MAX_SECONDS:g} (got {seconds}).", "seconds")
        num_frames = int(round(seconds * FPS))
        field = "seconds"
    else:
        field = "num_frames"
    aligned = align_num_frames(int(num_frames))
    if field == "seconds" and aligned / FPS > MAX_SECONDS:
        # 15 s is 360 frames, which snaps up to 362 (15.08 s); a length asked for in seconds takes the longest
        # valid count instead (345 frames, 14.4 s) rather than failing at the advertised upper bound.
        aligned = MAX_FRAMES
    check_duration(aligned, field)
    return Geometry(
        height=height,
        width=width,
        num_frames=aligned,
        num_latent_frames=video_latent_frames(aligned),
        latent_height=height // SPATIAL_COMPRESSION,
        latent_width=width // SPATIAL_COMPRESSION,
        num_audio_latents=audio_latent_frames(aligned),
    )
