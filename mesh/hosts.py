"""Which mesh axes cross hosts. A host is a process (pjax runs one per host, each seeing all its local devices),
and `jax.make_mesh` lays the devices out in order, each process's a consecutive block, so the innermost axes
(tp, then cp, pp, ep) stay inside a host as long as their product fits in one, and the outer ones (dp, rp) cross.
tp talks every layer, so a tp that crosses hosts is refused unless `mesh.tp_across_hosts` asks for it."""
from __future__ import annotations

from typing import Any

import numpy as np

from mesh.errors import ConfigError
from mesh.mesh import DP, KEYS, RP, TP


def axes_across_hosts(mesh: Any) -> tuple[str, ...]:
    """The mesh's axes along which some devices belong to different processes, in mesh order."""
    hosts = np.vectorize(lambda d: getattr(d, "process_index", 0))(mesh.devices)
    return tuple(name for i, name in enumerate(mesh.axis_names)
                 if hosts.shape[i] > 1 and bool(np.any(hosts != np.take(hosts, [0], axis=i))))


def across_hosts_line(mesh: Any) -> str | None:
    """'across hosts: dp, pp' (the mesh keys: rp, ZeRO's groups, counts as dp); None on one host."""
    crossing = axes_across_hosts(mesh)
    if len({getattr(d, "process_index", 0) for d in mesh.devices.flat}) < 2:
        return None
    keys = [key for key in KEYS if key in crossing or (key == DP and RP in crossing)]
    return f"across hosts: {', '.join(keys) if keys else 'none'}"


def check_tp(mesh: Any, allowed: bool) -> None:
    """One line where tp crosses hosts and `mesh.tp_across_hosts` does not ask for it."""
    if allowed or TP not in axes_across_hosts(mesh):
        return
    per_host = len([d for d in mesh.devices.flat if getattr(d, "process_index", 0) == 0])
    raise ConfigError(f"mesh.tp={mesh.shape[TP]} spans hosts of {per_host} devices: tp all-reduces in every layer "
                      f"and would cross the network; keep mesh.tp <= {per_host} (and use dp or pp across hosts), or "
                      f"set mesh.tp_across_hosts=true.")
