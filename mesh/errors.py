"""The one exception type for user mistakes, in the lowest layer so every layer above can raise it."""


class ConfigError(ValueError):
    """A mistake in the user's configuration or inputs, stated in one sentence that says what to change."""


def first_line(error: BaseException, limit: int = 60) -> str:
    """A library's exception as a phrase for a one-line error: its type and its message's first line, cut to
    `limit` characters (the line's fix and its own words need the rest of the 200)."""
    lines = str(error).splitlines()
    if not lines:
        return type(error).__name__
    return f"{type(error).__name__}: {lines[0] if len(lines[0]) <= limit else lines[0][:limit] + '…'}"


def shown(value: object, limit: int = 80) -> str:
    """`value`'s repr cut to `limit` characters; an integer too long for Python to print, by its size."""
    if isinstance(value, int) and value.bit_length() > 3.33 * limit:  # log2(10) bits per digit
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return cut(repr(value), limit)


def listed(items: list[str], limit: int = 90) -> str:
    """The leading `items`, comma-separated, as many as fit in `limit` characters (one at least), and how many more."""
    shown = list(items[:1])
    for item in items[1:]:
        if len(", ".join([*shown, item])) > limit:
            break
        shown.append(item)
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def cut(text: str, limit: int = 80) -> str:
    """`text`, or its first `limit` characters and an ellipsis with the full length when longer."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def require(ok: bool, key: str, value: object, valid: str) -> None:
    """Raise the one-sentence ConfigError for an impossible value of config key `key` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={shown(value)} is invalid; {valid}.")


def require_choice(key: str, value: object, choices: tuple) -> None:
    require(value in choices, key, value, "choose one of " + ", ".join(str(c) for c in choices))
