"""Task-specific preparation: putting fl2va keyframes on the canvas, exactly as diffusers 0.42.1 does
(modular_pipelines/minimax_h3/before_encoder.py:115-164, `MiniMaxH3ResizeStep`)."""

from PIL import Image

KEYFRAME_ANCHORS = ("first", "last")


def place_keyframes(images: list, height: int, width: int) -> list:
    """Put keyframes (RGB PIL, in packed order) on a `width` x `height` canvas.

    The first keyframe is stretched (LANCZOS); a follower is scaled to cover the canvas and centre-cropped, with the
    reference's rounding (`round` to size, `(src - dst) // 2` to centre). Images already at the size pass through.
    """
    placed = []
    for index, image in enumerate(images):
        if image.size == (width, height):
            placed.append(image)
        elif index == 0:
            placed.append(image.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / image.size[0], height / image.size[1])
            size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            placed.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return placed
