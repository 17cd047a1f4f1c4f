"""How a run's checkpoint saves fail in one line: a full disk said once, with what a step needs, and
the leftovers of Orbax's abandoned reads and writes kept off the terminal (`checkpoint.Checkpointer`)."""
from __future__ import annotations

import errno
import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError

# How a full disk (or quota) reads in the errors of Python, tensorstore ("[os_error_code='28']") and Orbax.
_DISK_FULL = ("No space left on device", "Disk quota exceeded", "os_error_code='28'", "os_error_code='122'")


def disk_full_error(directory: str, step: int, size: int) -> ConfigError:
    """The one line for a save of `step` (`size` bytes) that ran out of space in `directory`: what to do, and from
    which step a rerun resumes (docs/checkpoints.md, "When things go wrong", says what is kept)."""
    done = sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())
    then = f"rerun to resume from step {done[-1]}" if done else "rerun (no earlier step was saved)"
    free = shutil.disk_usage(directory).free
    return ConfigError(f"checkpoint.dir={directory} is full: step {step} needs about {size_text(size)} and "
                       f"{size_text(free)} is free; free space, then {then}.")


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or one it came from) says the disk or the quota is full."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(mark in str(error) for mark in _DISK_FULL):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def size_text(num_bytes: float) -> str:
    if num_bytes < 1024:
        return f"{num_bytes:.0f} bytes"
    for unit in ("KB", "MB", "GB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.1f} {unit}"


def quiet_abandoned_io() -> None:
    """Drop what tensorstore reports ("Event loop is closed", "Task exception was never retrieved", a coroutine
    never awaited) as it finishes the reads or writes Orbax abandoned with a failed step and its asyncio loop."""
    if getattr(sys.unraisablehook, "pjax_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.pjax_quiet = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(lambda r: "exception was never retrieved" not in r.getMessage())
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


def quiet_disk_full_logs() -> None:
    """Keep Orbax's per-thread tracebacks of a full disk off the terminal (`Checkpointer` reports it in one line)."""
    absl_logger = logging.getLogger("absl")
    if not any(getattr(f, "pjax_disk_full", False) for f in absl_logger.filters):
        def keep(record: logging.LogRecord) -> bool:
            error = record.exc_info[1] if record.exc_info else None
            return not (any(mark in record.getMessage() for mark in _DISK_FULL) or
                        (error is not None and is_disk_full(error)))

        keep.pjax_disk_full = True
        absl_logger.addFilter(keep)
