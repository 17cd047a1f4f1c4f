"""Which JAX platforms an entry point starts, decided before JAX starts a backend. Standard library only: it runs
before JAX is imported.

JAX's CUDA plugin (`pjax[cuda12]`, `pjax[cuda13]`, and the `gpu-plan` extra the tests install) initialises on
every start and, on a host without an NVIDIA driver, prints a twenty-line traceback ("Unable to load cuFFT")
before JAX falls back to the CPU. Where JAX_PLATFORMS is unset, the plugin is installed and no driver can be
loaded, pjax starts JAX on the CPU instead, which is where JAX would have ended up, and says so in the run's
start-up line. The
plugin still registers its compile-only GPU topology (`pjax.plan.gpu_target`). A JAX_PLATFORMS the user sets is
kept as it is, silently. Where GPUs are evidently expected (`gpus_expected`: CUDA_VISIBLE_DEVICES, SLURM's GPU
variables, /dev/nvidia*) and the driver cannot load, training on the CPU would be a silent mistake:
`missing_gpu` gives the one-line error the entry points stop with."""
from __future__ import annotations

import ctypes
import glob
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
    return driver_error() is None


def driver_error() -> str | None:
    """Why the NVIDIA driver's library cannot be loaded here (the loader's message), or None where it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return str(e) or "libcuda.so.1 cannot be loaded"
    return None


_HIDDEN = ("", "-1", "none", "void", "nodevfiles")  # values that hide every GPU, on purpose


def gpus_expected(environ: MutableMapping[str, str] = os.environ, dev: str = "/dev") -> str | None:
    """What says this host should have GPUs, e.g. 'CUDA_VISIBLE_DEVICES=0,1', or None: a visible-devices list
    (CUDA's or the NVIDIA container runtime's), SLURM's GPUs for the job or step, or NVIDIA's device files."""
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
                 "SLURM_GPUS_ON_NODE"):
        value = environ.get(name, "").strip()
        if value.lower() not in (*_HIDDEN, "0" if name == "SLURM_GPUS_ON_NODE" else ""):
            return f"{name}={value}"
    files = sorted(glob.glob(os.path.join(dev, "nvidia[0-9]*")))
    return f"{files[0]} exists" if files else None


def missing_gpu(environ: MutableMapping[str, str] = os.environ, dev: str = "/dev") -> str | None:
    """The one-line error where GPUs are expected here, JAX_PLATFORMS is unset and the NVIDIA driver cannot load
    (JAX would fall back to the CPU, and a GPU job would train there); else None."""
    if environ.get("JAX_PLATFORMS") or not cuda_plugin_installed():
        return None
    evidence = gpus_expected(environ, dev)
    error = driver_error() if evidence else None
    if error is None:
        return None
    error = error.removeprefix("libcuda.so.1: ")
    error = error if len(error) <= 30 else error[:30] + "…"
    return (f"this host should have GPUs ({evidence}) but libcuda.so.1 does not load ({error}): fix the driver or "
            f"GPU access, or set JAX_PLATFORMS=cpu.")


FELL_BACK = "PJAX_CPU_FALLBACK"  # set where pjax chose the CPU for a host without a driver, not the user


def fallback_note(environ: MutableMapping[str, str] = os.environ) -> str:
    """What a run's start-up line adds where pjax, not the user, chose the CPU; '' elsewhere."""
    if environ.get(FELL_BACK) != "1" or environ.get("JAX_PLATFORMS") != "cpu":
        return ""
    return " (JAX's CUDA plugin is installed but this host has no NVIDIA driver: the CPU; JAX_PLATFORMS=cpu says so)"


def start_platforms(environ: MutableMapping[str, str] = os.environ, dev: str = "/dev") -> str | None:
    """Set JAX_PLATFORMS=cpu in `environ` where the CUDA plugin is installed and cannot find a GPU (no driver, no TPU
    library, no sign that GPUs should be here), and mark it for the run's start-up line (`fallback_note`); returns
    what it set, or None where it left JAX's choice alone. Call it before JAX starts a backend: an entry point's
    first line, and `pjax.cli.run_main`."""
    if environ.get("JAX_PLATFORMS") or not cuda_plugin_installed() or nvidia_driver():
        return None
    if importlib.util.find_spec("libtpu") is not None or gpus_expected(environ, dev):  # the latter: `missing_gpu`
        return None
    environ["JAX_PLATFORMS"] = "cpu"
    environ[FELL_BACK] = "1"  # for the run's start-up line (`fallback_note`), past a re-exec
    if environ is os.environ and "jax" in sys.modules:  # JAX read the variable when imported: tell its config too
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return "cpu"
