"""The backend a step is built for: the one JAX runs on, or the one the planner compiles for ahead of time.

The model and the parallel code pick their XLA:CPU forms (a materialised transpose, fp32 compute, the blocked
attention) by backend. When `pjax.plan` compiles a step for GPUs from a host without one (compile-only devices
of XLA:GPU, `pjax.plan.gpu_target`), JAX's default backend is still the CPU; `building_for("gpu")` makes the
step's code take its GPU forms while it is traced."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax

from mesh.scoped import scoped

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pjax_target_backend", default=None)
_DEVICE: contextvars.ContextVar[Any] = contextvars.ContextVar("pjax_target_device", default=None)


def target_backend() -> str:
    """'cpu', 'gpu' or 'tpu': the backend set by `building_for`, else JAX's default."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def building_for(backend: str, device: Any = None) -> Iterator[None]:
    """Trace the step inside this block as it is traced on `backend`; `device`: one of the compile-only devices
    it is built for (`target_device`)."""
    with scoped(_TARGET, backend), scoped(_DEVICE, device):
        yield


def target_device() -> Any:
    """A device of the compile-only target `building_for` named, else None (JAX's own devices)."""
    return _DEVICE.get()


def on_target() -> contextlib.AbstractContextManager[Any]:
    """JAX's default device is the compile-only target's inside this block: a kernel library that asks the default
    device what it runs on (tokamax) lowers for the target. No eager work may run in it (nothing can run there)."""
    device = _DEVICE.get()
    return jax.default_device(device) if device is not None else contextlib.nullcontext()
