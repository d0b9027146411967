"""Progress (and cancellation) points inside one long call of a model."""

from contextlib import contextmanager
from typing import Callable

# The stages of one clip, in the order they run; progress, job status and metrics name them this way. "plan" (the
# prompt planner) runs first when a request asks for it; a clip over 15 s repeats encode_conditions .. write_mp4 per
# window.
STAGES = ("encode_text", "encode_conditions", "denoise", "decode_video", "decode_audio", "write_mp4")
# Not a stage: a preview made while denoising (`preview.py`) is reported as `callback(PREVIEW, forward, forwards,
# preview)` to a callback that takes the fourth argument.
PREVIEW = "preview"


@contextmanager
def checkpoints(modules, check: Callable[[], None]):
    """Run `check()` before each forward of `modules`: progress (and cancellation) points inside one long call. An
    exception `check` raises propagates out of the call; the hooks are removed either way."""
    handles = [module.register_forward_pre_hook(lambda *_: check()) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
