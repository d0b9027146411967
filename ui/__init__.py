"""The Gradio web UI (`h3gen.ui`), mounted at `/ui` by `h3gen serve`."""
