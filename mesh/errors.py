"""The one exception type for user mistakes.

It lives in `mesh/`, the lowest layer, so that every layer above (models, pjax) can raise it
without importing upwards. `pjax.ConfigError` is the same class.
"""


class ConfigError(ValueError):
    """A mistake in the user's configuration or inputs, stated in one sentence that says what to change."""
