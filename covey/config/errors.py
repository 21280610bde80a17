"""The config's error type: what every check of a setting raises, one user-facing line."""


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""
