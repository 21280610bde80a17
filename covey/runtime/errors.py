"""One-line error messages: covey reports failures as a single line naming what failed."""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
