"""The error of model loading and preparation: one line, for the user."""


class ModelError(ValueError):
    """A one-line, user-facing model loading/preparation error."""
