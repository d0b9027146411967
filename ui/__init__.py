"""The Gradio web UI (`h3gen.ui`)."""
