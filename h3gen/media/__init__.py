"""Media in and out: MP4s written with PyAV and verified by decoding them back (`mp4`), keyframe images and uploads
(`uploads`), reference video and audio (`decode`), audio resampling (`resample`) and MP4 previews (`previews`).

The names below are the package's public API; importing it loads neither torch, PyAV nor PIL (each is imported where
it is used).
"""

from h3gen.media.decode import (
    MAX_AUDIO_RATE,
    MAX_MEDIA_SECONDS,
    MIN_AUDIO_RATE,
    VideoFileInfo,
    check_audio_rate,
    iter_video_frames,
    probe_video,
    read_audio,
)
from h3gen.media.errors import MediaError, shown_name
from h3gen.media.mp4 import (
    AUDIO_RATES,
    DEFAULT_PRESET,
    NVENC,
    BackgroundEncode,
    MediaInfo,
    Mp4Writer,
    check_mp4,
    nvenc_available,
    probe_mp4,
    rgb_to_yuv420,
    video_encoder,
    write_mp4,
)
from h3gen.media.previews import (
    PREVIEW_QUALITY,
    SPRITESHEET_COLUMNS,
    SPRITESHEET_ROWS,
    SPRITESHEET_TILE_WIDTH,
    mp4_spritesheet,
    mp4_thumbnail,
)
from h3gen.media.resample import resample_stream
from h3gen.media.uploads import (
    AUDIO_FORMATS,
    IMAGE_FORMATS,
    MAX_IMAGE_PIXELS,
    VIDEO_FORMATS,
    check_pixels,
    read_image,
    upload_suffix,
)

__all__ = [
    "AUDIO_FORMATS",
    "AUDIO_RATES",
    "DEFAULT_PRESET",
    "IMAGE_FORMATS",
    "MAX_AUDIO_RATE",
    "MAX_IMAGE_PIXELS",
    "MAX_MEDIA_SECONDS",
    "MIN_AUDIO_RATE",
    "NVENC",
    "PREVIEW_QUALITY",
    "SPRITESHEET_COLUMNS",
    "SPRITESHEET_ROWS",
    "SPRITESHEET_TILE_WIDTH",
    "VIDEO_FORMATS",
    "BackgroundEncode",
    "MediaError",
    "MediaInfo",
    "Mp4Writer",
    "VideoFileInfo",
    "check_audio_rate",
    "check_mp4",
    "check_pixels",
    "iter_video_frames",
    "mp4_spritesheet",
    "mp4_thumbnail",
    "nvenc_available",
    "probe_mp4",
    "probe_video",
    "read_audio",
    "read_image",
    "resample_stream",
    "rgb_to_yuv420",
    "shown_name",
    "upload_suffix",
    "video_encoder",
    "write_mp4",
]
