"""The backend a step is built for: the one JAX runs on, or the one the planner compiles for ahead of time.

The model and the parallel code pick their XLA:CPU forms (a materialised transpose, fp32 compute, the blocked
attention) by backend. When `pjax.plan` compiles a step for GPUs from a host without one (compile-only devices
of XLA:GPU, `pjax.plan.gpu_target`), JAX's default backend is still the CPU; `building_for("gpu")` makes the
step's code take its GPU forms while it is traced."""
from __future__ import annotations

import contextlib
import contextvars

import jax

from mesh.scoped import scoped

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pjax_target_backend", default=None)


def target_backend() -> str:
    """'cpu', 'gpu' or 'tpu': the backend set by `building_for`, else JAX's default."""
    return _TARGET.get() or jax.default_backend()


def building_for(backend: str) -> contextlib.AbstractContextManager[None]:
    """Trace the step inside this block as it is traced on `backend`."""
    return scoped(_TARGET, backend)
