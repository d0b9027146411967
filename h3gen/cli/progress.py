"""What a running command shows on stderr: its own progress bars (tqdm, imported when a bar starts) and no
library's bars or deprecation chatter."""

import os
import sys
from pathlib import Path


def progress_bar(units: dict[str, int]):
    """A tqdm bar over stages and denoising steps, and the `callback(stage, step, total)` that feeds it. `units`
    gives each stage, in running order, its share of the bar (a stage's own reports are scaled into it). The bar
    names the stage that is running: stages report when they start."""
    from tqdm import tqdm

    order = list(units)
    bar = tqdm(total=sum(units.values()), unit="step", dynamic_ncols=True, file=sys.stderr)

    def callback(stage: str, step: int, stage_total: int) -> None:
        if stage not in units:
            return
        before = sum(units[name] for name in order[: order.index(stage)])
        position = before + units[stage] * min(step, stage_total) // max(stage_total, 1)
        _show(bar, stage, position)

    return bar, callback


def window_bar(windows: int, steps: int):
    """A tqdm bar over a long clip's windows (each: its denoising steps and its write), and its callback."""
    from tqdm import tqdm

    per_window = steps + 1
    bar = tqdm(total=windows * per_window, unit="step", dynamic_ncols=True, file=sys.stderr)
    window = 0

    def callback(stage: str, step: int, stage_total: int) -> None:
        nonlocal window
        if stage == "window":
            window = step
            position = step * per_window
        elif stage == "denoise":
            position = window * per_window + min(step, steps)
        elif stage == "write_mp4" and step == stage_total:
            position = min(window * per_window + per_window, windows * per_window)
        else:
            position = bar.n
        where = f"window {min(window + 1, windows)}/{windows}"
        _show(bar, where if stage == "window" else f"{where} {stage}", position)

    return bar, callback


def _show(bar, description: str, position: int) -> None:
    """Move `bar` to `position` named `description`: a new description shows at once even when the bar does not move
    (a stage that starts), an advance redraws at tqdm's pace."""
    if position > bar.n:
        bar.set_description(description, refresh=False)
        bar.update(position - bar.n)  # tqdm redraws at most every 0.1 s
    elif bar.desc.removesuffix(": ") != description:
        bar.set_description(description)


def with_previews(callback, path):
    """`callback(stage, step, total)` that also writes each preview (`pipelines.h3.Preview`) to `path` as a JPEG,
    replacing the last one by rename (a viewer never reads half a picture)."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")

    def report(stage: str, step: int, total: int, preview=None) -> None:
        if preview is None:
            callback(stage, step, total)
            return
        partial.write_bytes(preview.jpeg())
        os.replace(partial, target)

    return report


def quiet_libraries() -> None:
    """Keep the CLI's output to our own bar and messages: no per-library progress bars or deprecation chatter."""
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    for library in (transformers_logging, diffusers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()
