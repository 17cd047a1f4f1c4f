"""XLA:CPU's per-run buffers on transparent huge pages: glibc's `malloc.hugetlb` tunable, which glibc
reads only at process start, hence a restart (ARCHITECTURE.md, "XLA:CPU's buffers on huge pages";
figures in benchmarks/README.md). Standard library only: this runs before JAX is imported."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_at_least(major: int, minor: int) -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (major, minor)
    except (AttributeError, ValueError, OSError):  # not glibc (musl, macOS)
        return False


def _cpu_backend(environ: Mapping[str, str]) -> bool:
    """True when JAX will run on XLA:CPU: JAX_PLATFORMS says cpu, or no accelerator plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not list(importlib.metadata.entry_points(group="jax_plugins")) and importlib.util.find_spec("libtpu") is None


def huge_pages_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What to add to `environ` to put XLA:CPU's buffers on huge pages ({} where nothing applies)."""
    if not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in environ or not _glibc_at_least(2, 35):
        return {}
    try:
        with open(THP_MODE) as f:
            if "[madvise]" not in f.read():
                return {}
    except OSError:
        return {}
    return {"GLIBC_TUNABLES": TUNABLE} if _cpu_backend(environ) else {}


def restart_with_huge_pages() -> None:
    """Re-exec this command with `huge_pages_env()` set, where it sets anything: first thing in a
    `__main__`, before JAX is imported (same pid; the new process finds GLIBC_TUNABLES set)."""
    env = huge_pages_env()
    if env:
        os.environ.update(env)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
