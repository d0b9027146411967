"""Preview images of a finished MP4 (the OpenAI video API's `thumbnail` and `spritesheet` variants): JPEGs of frames
spread evenly over the clip."""

import numpy as np

from h3gen.media.errors import MediaError

SPRITESHEET_COLUMNS, SPRITESHEET_ROWS = 5, 5
SPRITESHEET_TILE_WIDTH = 256  # pixels; a tile keeps the video's aspect ratio
PREVIEW_QUALITY = 90  # JPEG quality


def _sampled_frames(path, count: int) -> list[np.ndarray]:
    """`count` frames of an MP4 spread evenly over its length (first to last), `(H, W, 3)` uint8 RGB."""
    import av

    try:
        with av.open(str(path)) as container:
            total = container.streams.video[0].frames
            if total <= 0:  # a container that does not say: decode once to count
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            wanted = {round(i * (total - 1) / max(count - 1, 1)) for i in range(count)} if count > 1 else {total // 2}
            frames = [
                frame.to_ndarray(format="rgb24")
                for index, frame in enumerate(container.decode(video=0))
                if index in wanted
            ]
    except (av.error.FFmpegError, IndexError) as error:
        raise MediaError(f"the video does not decode: {error}") from None
    if not frames:
        raise MediaError("the video has no frames.")
    return frames


def _jpeg(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=PREVIEW_QUALITY)
    return buffer.getvalue()


def mp4_thumbnail(path) -> bytes:
    """A JPEG of the MP4's middle frame, at the video's own size."""
    from PIL import Image

    return _jpeg(Image.fromarray(_sampled_frames(path, 1)[0]))


def mp4_spritesheet(path, columns: int = SPRITESHEET_COLUMNS, rows: int = SPRITESHEET_ROWS) -> tuple[bytes, dict]:
    """A JPEG grid of `columns` x `rows` frames spread evenly over the MP4 (left to right, then top to bottom),
    each `SPRITESHEET_TILE_WIDTH` wide (at most the video's width) with the video's aspect ratio; and the grid's
    layout `{columns, rows, tile_width, tile_height, frames}` (`frames`: the tiles filled)."""
    from PIL import Image

    frames = _sampled_frames(path, columns * rows)
    height, width = frames[0].shape[:2]
    tile_width = min(SPRITESHEET_TILE_WIDTH, width)
    tile_height = max(1, round(height * tile_width / width))
    sheet = Image.new("RGB", (columns * tile_width, rows * tile_height))
    for index, frame in enumerate(frames):
        tile = Image.fromarray(frame).resize((tile_width, tile_height), Image.Resampling.BILINEAR)
        sheet.paste(tile, ((index % columns) * tile_width, (index // columns) * tile_height))
    layout = {
        "columns": columns,
        "rows": rows,
        "tile_width": tile_width,
        "tile_height": tile_height,
        "frames": len(frames),
    }
    return _jpeg(sheet), layout
