"""User-facing errors. Each message names what was wrong and what is allowed."""


class RequestError(ValueError):
    """A generation request the model cannot serve (bad size, aspect ratio, length, file ...).

    Raised before any GPU work. The CLI prints it as one line; the server answers 422 naming the field.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: missing files or components, missing, unexpected or
    mis-shaped tensors. The message names the folder and the offending keys."""
