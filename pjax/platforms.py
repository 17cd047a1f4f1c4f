"""Which JAX platforms an entry point starts, decided before JAX starts a backend. Standard library only: it runs
before JAX is imported.

JAX's CUDA plugin (`pjax[cuda12]`, `pjax[cuda13]`, and the `gpu-plan` extra the tests install) initialises on
every start and, on a host without an NVIDIA driver, prints a twenty-line traceback ("Unable to load cuFFT")
before JAX falls back to the CPU. Where JAX_PLATFORMS is unset, the plugin is installed and no driver can be
loaded, pjax starts JAX on the CPU instead, which is where JAX would have ended up. The plugin still registers
its compile-only GPU topology (`pjax.plan.gpu_target`). A JAX_PLATFORMS the user sets is kept as it is."""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
from typing import MutableMapping


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins is installed (an entry point of group `jax_plugins` named for CUDA)."""
    return any("cuda" in ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))


def nvidia_driver() -> bool:
    """Whether the NVIDIA driver's library can be loaded here (what the CUDA plugin needs to see a GPU)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def start_platforms(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set JAX_PLATFORMS=cpu in `environ` where the CUDA plugin is installed and cannot find a GPU (no driver, no
    TPU library either); returns what it set, or None where it left JAX's choice alone. Call it before JAX
    starts a backend: an entry point's first line, and `pjax.cli.run_main`."""
    if environ.get("JAX_PLATFORMS") or not cuda_plugin_installed() or nvidia_driver():
        return None
    if importlib.util.find_spec("libtpu") is not None:
        return None
    environ["JAX_PLATFORMS"] = "cpu"
    if environ is os.environ and "jax" in sys.modules:  # JAX read the variable when imported: tell its config too
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return "cpu"
