"""XLA:CPU's per-run buffers on transparent huge pages: glibc's `malloc.hugetlb` tunable.

XLA:CPU allocates each executable's temporaries as one buffer per run (picotron-cpu: ~200 MB per
device), from a pool thread. glibc serves an allocation that size with a fresh `mmap` and
returns it with `munmap` when the run ends, so every step touches ~200 MB of new 4 KB pages per
device: ~108k page faults per pp=2 step here, 0.2 of its 1.4 CPU-seconds spent in the kernel.
With `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35) malloc asks for transparent huge
pages on those mappings, 2 MB each: ~1.5k faults per step, and picotron-cpu runs 5-12% faster
on every layout (benchmarks/README.md).

glibc reads its tunables once, when the process starts, so `pjax.train` restarts itself with
the setting (`restart_with_huge_pages`, before JAX is imported) and `benchmarks/step.py` passes
it to the processes it starts (`huge_pages_env`). Only where it applies and was measured:
Linux with glibc >= 2.35, the kernel's huge pages in `madvise` mode (with `always` mappings get
them anyway, with `never` they cannot), and XLA:CPU as the backend (no accelerator plugin, or
JAX_PLATFORMS=cpu). A GLIBC_TUNABLES the user set is left alone.

Standard library only: this module runs before JAX is imported.
"""
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
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (major, minor)
    except (AttributeError, ValueError, OSError):  # not glibc (musl, macOS)
        return False


def _cpu_backend(environ: Mapping[str, str]) -> bool:
    """True when JAX will run on XLA:CPU: JAX_PLATFORMS says cpu, or no accelerator plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    # GPU plugins register under "jax_plugins"; TPUs come with the libtpu package.
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
    """Re-run this command (`sys.orig_argv`) with `huge_pages_env()` set, where it sets anything.

    Call it first thing in a `__main__`, before JAX is imported: the restart replaces the process
    (same pid, arguments and descriptors) and the new one finds GLIBC_TUNABLES set and goes on.
    """
    env = huge_pages_env()
    if env:
        os.environ.update(env)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
