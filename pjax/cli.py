"""What every entry point shares: a user's mistake ends as one `error:` line and exit status 2, and
every directory a run will write to is checked before any work, so a wrong path loses nothing."""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Any, Callable

from mesh import watchdog
from mesh.errors import ConfigError, cut
from pjax.platforms import missing_gpu, start_platforms


class ArgumentParser(argparse.ArgumentParser):
    """argparse, except that a bad command line is one `error:` line too."""

    def error(self, message: str):
        fail(f"{message}; run `{self.prog} --help` for the options.")
        sys.exit(2)


def run_main(body: Callable[[], Any]) -> int:
    """Run `body`; a ConfigError or uncaught file-system error becomes one `error:` line and exit status 2.
    JAX starts on the CPU where its CUDA plugin is installed and no GPU can be, and not at all where GPUs should be
    and their driver cannot load (`pjax.platforms`)."""
    start_platforms()
    missing = missing_gpu()
    if missing:
        return fail(missing)
    code = _one_line_errors(body)
    if code:
        watchdog.exit_now(code)  # in a multi-process run: the others stop on this error, JAX's barrier would wait
    return code


def _one_line_errors(body: Callable[[], Any]) -> int:
    """`body`'s exit status: 0, or 2 after the one `error:` line of a mistake it raised."""
    try:
        body()
    except ConfigError as e:
        return fail(str(e))
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return fail(f"{e.strerror or e}{where}; check that path and the space left on its disk.")
    except ValueError as e:  # jax's IndivisibleError (private): a shape no validator foresaw
        if type(e).__name__ != "IndivisibleError":
            raise
        return fail(f"a dimension does not split over the mesh ({_indivisible(e)}); choose mesh.dp, mesh.pp, "
                    f"mesh.cp and mesh.tp that divide the model's and the batch's sizes.")
    return 0


def _indivisible(error: ValueError) -> str:
    """jax's IndivisibleError as a phrase: which axis of which shape splits how many ways, else its first line cut."""
    text = str(error)
    match = re.search(r"array axis (\d+) is partitioned (\d+) times, but the dimension size is (\d+) "
                      r"\(full shape: (\([^)]*\))", text)
    if match:
        axis, ways, _, shape = match.groups()  # the size is in the shape
        return f"axis {axis} of shape {shape} split {ways} ways"
    return cut(text.splitlines()[0] if text else type(error).__name__, 60)


def fail(message: str) -> int:
    """Print the one-line error, over-long words cut, and return exit status 2."""
    print(error_line(message), file=sys.stderr)
    return 2


def error_line(message: str) -> str:
    """The `error:` line `fail` prints for `message`: one line, over-long words cut."""
    return f"error: {' '.join(_short(word) for word in message.split())}"


def _short(word: str, limit: int = 100) -> str:
    if len(word) <= limit:
        return word
    stem = word.rstrip(").,;:'\"")  # the sentence's punctuation after the word stays
    return cut(stem, limit) + word[len(stem):]


def writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and check a file can be written in it; else a ConfigError naming `key`."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".pjax-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}={path} is not a writable directory ({e.strerror or e}); point {key} at a "
                          f"directory you can write to.") from None
