"""Files that come in through the UI: only what Gradio received as an upload, stored under the type it decodes as."""

import shutil
from pathlib import Path

import av
from PIL import Image

from h3gen.errors import RequestError
from h3gen.server.engine import upload_name

# PIL's format names and FFmpeg's container names -> the suffix a stored file gets.
IMAGE_SUFFIXES = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff"}
VIDEO_SUFFIXES = {"mov": ".mp4", "mp4": ".mp4", "matroska": ".mkv", "webm": ".webm", "avi": ".avi"}
AUDIO_SUFFIXES = {
    "mov": ".m4a",
    "mp4": ".m4a",
    "mp3": ".mp3",
    "wav": ".wav",
    "ogg": ".ogg",
    "flac": ".flac",
    "aac": ".aac",
    "matroska": ".mka",
    "webm": ".mka",
}


def decoded_type(path: Path, field: str) -> tuple[str, str]:
    """What `path` decodes as, whatever it is named: ("image" | "video" | "audio", suffix such as ".png", ".mp4",
    ".m4a"). A file that is none of these raises `RequestError` naming `field` (never the path)."""
    try:
        with Image.open(path) as image:
            image.verify()
            if image.format in IMAGE_SUFFIXES:
                return "image", IMAGE_SUFFIXES[image.format]
    except Exception:  # not an image PIL knows: ask FFmpeg
        pass
    try:
        with av.open(str(path)) as container:
            kind = "video" if container.streams.video else "audio" if container.streams.audio else None
            table = {"video": VIDEO_SUFFIXES, "audio": AUDIO_SUFFIXES}.get(kind, {})
            for name in container.format.name.split(","):  # e.g. "mov,mp4,m4a,3gp,3g2,mj2"
                if name in table:
                    return kind, table[name]
    except (av.error.FFmpegError, OSError, ValueError):
        pass
    raise RequestError(f"{field}: the file is not an image, video or audio file this server reads.", field)


def uploaded_by_user(path, upload_folder: Path) -> bool:
    """Whether `path` lies inside Gradio's upload folder (where everything a browser uploads goes)."""
    try:
        return Path(path).resolve().is_relative_to(upload_folder.resolve())
    except (OSError, ValueError):
        return False


def checked_upload(path, field: str, upload_folder: Path) -> tuple[Path, str, str]:
    """`(path, kind, suffix)` of one UI upload; refuses any file Gradio did not receive as an upload."""
    if not uploaded_by_user(path, upload_folder) or not Path(path).is_file():
        raise RequestError(f"{field}: the file was not uploaded through this page; upload it again.", field)
    return Path(path), *decoded_type(Path(path), field)


def stage(path: Path, folder: Path, name: str, suffix: str) -> Path:
    """Copy a checked upload into the job's staging `folder` as `<name><suffix>`. Gradio's copies may vanish (its
    cache is swept), so the job keeps its own."""
    target = folder / f"{name}{suffix}"
    shutil.copyfile(path, target)
    return target


def stage_uploads(image, last_image, references, staging: Path, upload_folder: Path) -> dict[str, Path]:
    """A UI request's files copied into `staging` under their decoded type: fl2va keyframes as `image` /
    `last_image`, ref2va references keyed as the REST API keys them (`ref_<kind>_<position>`, the kind decoded)."""
    checked = [
        (name, checked_upload(path, name, upload_folder))
        for name, path in (("image", image), ("last_image", last_image))
        if path
    ]
    for position, path in enumerate(references or []):
        path = getattr(path, "name", path)  # Gradio hands file paths (or objects with .name)
        found = checked_upload(path, "references", upload_folder)
        checked.append((upload_name(f"ref_{found[1]}", position), found))
    return {name: stage(path, staging, name, suffix) for name, (path, _kind, suffix) in checked}
