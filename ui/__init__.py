"""The Gradio web UI (`h3gen.ui`), mounted at `/ui` by `h3gen serve` through `mount_ui`."""

if __name__ == "ui":  # a bare import from the checkout root: the installed `ui` stands in
    from h3gen.checkout_names import defer_to_installed

    defer_to_installed(__name__, __file__)
else:
    from h3gen.ui.mount import mount_ui

    __all__ = ["mount_ui"]
