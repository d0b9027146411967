"""What an uploaded or given file is: keyframe images read with the pixel cap checked from the header, and the suffix
an upload is stored under, from what its content decodes as (image, video or audio)."""

import warnings
from pathlib import Path

import numpy as np

from h3gen.errors import RequestError
from h3gen.media.errors import shown_name

# Most pixels an input image (or a reference video's frame) may hold: 40 MP, above any camera still or 8K frame, and
# 160 MB as RGB. Checked from the file's header before a pixel is decoded, so a small file that claims a huge canvas
# (a decompression bomb) costs nothing. The server, the UI, the CLI and the Python API all read images through here.
MAX_IMAGE_PIXELS = 40_000_000

# What an upload's content decodes as, by field kind: container/format name -> the suffix it is stored under.
IMAGE_FORMATS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff"}
VIDEO_FORMATS = {
    "mov,mp4,m4a,3gp,3g2,mj2": ".mp4",
    "matroska,webm": ".mkv",
    "avi": ".avi",
    "mpegts": ".ts",
    "mpeg": ".mpg",
}
AUDIO_FORMATS = {
    "wav": ".wav",
    "mp3": ".mp3",
    "flac": ".flac",
    "ogg": ".ogg",
    "aac": ".aac",
    "mov,mp4,m4a,3gp,3g2,mj2": ".m4a",
    "matroska,webm": ".mka",
}


def _pixel_cap_error(field: str, size: str) -> RequestError:
    return RequestError(f"{field} is {size}; images may hold at most {MAX_IMAGE_PIXELS / 1e6:g} MP.", field)


def _open_image(path):
    """`PIL.Image.open` (header only) without PIL's own bomb warning: the caller checks the pixel count itself."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(path)


def check_pixels(width: int, height: int, field: str) -> None:
    """Raise `RequestError` naming `field` when a `width` x `height` picture exceeds `MAX_IMAGE_PIXELS`."""
    if width * height > MAX_IMAGE_PIXELS:
        raise _pixel_cap_error(field, f"{width}x{height} = {width * height / 1e6:.1f} MP")


def read_image(source, field: str = "image"):
    """A keyframe as an RGB PIL image, from a path, PIL image or `(H, W, 3)` uint8 array.

    Raises `RequestError` naming `field` for a missing, unreadable, truncated or non-image file, or one of more than
    `MAX_IMAGE_PIXELS` pixels (checked from its header, before decoding).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] not in (3, 4) or source.dtype != np.uint8:
            raise RequestError(
                f"{field} array must be (height, width, 3) uint8 (got {source.shape}, {source.dtype}).", field
            )
        return Image.fromarray(source[..., :3])
    path = Path(source)
    if not path.is_file():
        raise RequestError(f"{field} file {shown_name(path)} does not exist.", field)
    try:
        with _open_image(path) as image:
            check_pixels(*image.size, field)
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError:
        raise _pixel_cap_error(field, "larger than PIL opens") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        if isinstance(error, RequestError):
            raise
        raise RequestError(
            f"{field} file {shown_name(path)} is not a readable image ({type(error).__name__}).", field
        ) from None


def upload_suffix(path, kind: str, field: str) -> str:
    """The suffix an uploaded file is stored under, from what its content decodes as (never the name a client
    gave): `kind` "image" (PNG, JPEG, WebP, GIF, BMP, TIFF; pixel count checked from the header), "video" (MP4/MOV,
    WebM/MKV, AVI, MPEG-TS, MPEG with a video stream) or "audio" (WAV, MP3, FLAC, OGG, AAC, M4A, MKA, or a video
    container whose soundtrack is taken). Raises `RequestError` naming `field` for content of another kind."""
    if kind == "image":
        from PIL import Image

        try:
            with _open_image(path) as image:
                found, size = image.format, image.size
        except Image.DecompressionBombError:
            raise _pixel_cap_error(field, "larger than PIL opens") from None
        except Exception:  # whatever PIL cannot identify is simply not an image
            found, size = None, (0, 0)
        if found not in IMAGE_FORMATS:
            raise RequestError(f"{field} is not a readable image (send PNG, JPEG, WebP, GIF, BMP or TIFF).", field)
        check_pixels(*size, field)
        return IMAGE_FORMATS[found]
    import av

    formats = VIDEO_FORMATS if kind == "video" else AUDIO_FORMATS
    try:
        with av.open(str(path)) as container:
            name, has_video, has_audio = (
                container.format.name,
                bool(container.streams.video),
                bool(container.streams.audio),
            )
            size = (
                (container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height)
                if has_video
                else (0, 0)
            )
    except (av.error.FFmpegError, OSError, ValueError):
        name, has_video, has_audio, size = None, False, False, (0, 0)
    if kind == "video":
        if name not in formats or not has_video:
            raise RequestError(f"{field} is not a readable video (send MP4, MOV, WebM, MKV, AVI or MPEG).", field)
        check_pixels(*size, field)
        return ".webm" if name == "matroska,webm" and _is_webm(path) else formats[name]
    if name not in formats and name not in VIDEO_FORMATS:
        raise RequestError(f"{field} is not a readable audio file (send WAV, MP3, M4A, FLAC, OGG or AAC).", field)
    if not has_audio:
        raise RequestError(f"{field} has no audio stream.", field)
    if name == "matroska,webm" and _is_webm(path):
        return ".webm"
    if has_video and name in VIDEO_FORMATS:  # a video given for its soundtrack keeps a video's suffix
        return VIDEO_FORMATS[name]
    return formats.get(name) or VIDEO_FORMATS[name]


def _is_webm(path) -> bool:
    """Matroska files declare their flavour in the EBML header's DocType, within the first bytes."""
    with open(path, "rb") as handle:
        return b"webm" in handle.read(64)
