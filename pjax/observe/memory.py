"""Memory per device: what a compiled step needs, what a device allows, and the check before a run."""
from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

from mesh.errors import ConfigError


def step_memory_bytes(compiled: Any) -> int:
    """Per-device bytes a compiled step needs: arguments + outputs - donated aliases + temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def device_memory_limit(device: jax.Device) -> int | None:
    """Bytes the runtime lets one device allocate (GPU/TPU), or None where it does not say (CPU)."""
    stats = device.memory_stats()
    return stats.get("bytes_limit") if stats else None


def preallocation_hint(platform: str) -> str:
    """On GPUs, the setting that lets JAX's allocator use more of the card (its limit is a fraction of it, .75 by
    default), with its value now; "" elsewhere."""
    if platform != "gpu" or os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return ""
    return f"XLA_PYTHON_CLIENT_MEM_FRACTION ({os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '.75')})"


def memory_fixes(platform: str) -> str:
    """What to raise or set when a step does not fit a device (docs/troubleshooting.md, "During training", lists
    the rest: fewer rows per device, more tp or pp)."""
    hint = preallocation_hint(platform)
    return ("raise train.grad_accum, set train.remat=full" +
            (f", raise train.zero or {hint}" if hint else " or raise train.zero"))


def check_fits(compiled: Any, mesh: Mesh) -> None:
    """A one-line ConfigError, before anything runs, when the step needs more memory per device than a device has."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    limit = device_memory_limit(local[0])
    need = step_memory_bytes(compiled)
    if limit and need > limit:
        size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
        raise ConfigError(f"the step needs {size(need)} per device and a device has {size(limit)}: "
                          f"{memory_fixes(local[0].platform)} (docs/troubleshooting.md).")
