"""The Gradio web UI (`h3gen.ui`), mounted at `/ui` by `h3gen serve` through `mount_ui`."""

from h3gen.ui.mount import mount_ui

__all__ = ["mount_ui"]
