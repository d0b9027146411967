"""What the media modules share when they fail: `MediaError` (an MP4 that could not be written, decoded or
previewed) and `shown_name`, the way every message names a file."""

from pathlib import Path


class MediaError(RuntimeError):
    """An MP4 could not be written or did not decode back as written."""


def shown_name(path) -> str:
    """How a message names a file: its name only, never the folder it lies in (a server's paths stay private)."""
    return Path(path).name
