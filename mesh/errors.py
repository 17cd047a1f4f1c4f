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


def shown(value: object, limit: int = 80) -> str:
    """`value` as an error message echoes it: its repr, cut to `limit` characters with an ellipsis
    (a 10,000-character value must not become a 10,000-character error line). An integer too long
    for Python to print (over 4,300 digits) is described by its size instead."""
    if isinstance(value, int) and value.bit_length() > 3.33 * limit:  # log2(10) bits per digit
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return cut(repr(value), limit)


def cut(text: str, limit: int = 80) -> str:
    """`text`, or its first `limit` characters and an ellipsis with the full length when longer."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"
