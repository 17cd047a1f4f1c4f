"""The one exception type for user mistakes.

It lives in `mesh/`, the lowest layer, so that every layer above (models, pjax) can raise it
without importing upwards. `pjax.ConfigError` is the same class.
"""


class ConfigError(ValueError):
    """A mistake in the user's configuration or inputs, stated in one sentence that says what to change."""


def first_line(error: BaseException, limit: int = 120) -> str:
    """A library's exception as a short phrase for a one-line error: its type and the first line
    of its message (library messages run to many lines, or to none)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__
