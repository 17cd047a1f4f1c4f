"""Process start-up: multi-host initialisation and forced CPU devices, before JAX's backend starts.

Both must run before the first call that touches devices (`jax.devices()`, any computation):
after that XLA's device count and the process group are fixed.
"""
from __future__ import annotations

import os

import jax

from mesh.mesh import MeshConfig

DEFAULT_CPU_DEVICES = 8  # what `mesh.dp=-1` fills when there is no accelerator


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Join a multi-process run when asked to: explicit arguments, or a SLURM job of several tasks.

    Returns True when `jax.distributed.initialize` was called. One process per host, each seeing
    its local accelerators; JAX discovers the coordinator from SLURM's environment itself.
    """
    if coordinator is not None or num_processes is not None:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        jax.distributed.initialize()
        return True
    return False


def force_cpu_devices(mesh_cfg: MeshConfig) -> int:
    """Ask XLA:CPU for as many devices as the mesh needs (8 when dp=-1 fills them).

    Only the CPU backend is affected: on a GPU or TPU host the accelerators stay the default
    devices, so this is safe to call unconditionally before the backend starts.
    """
    rest = mesh_cfg.pp * mesh_cfg.cp * mesh_cfg.tp
    n = mesh_cfg.dp * rest if mesh_cfg.dp > 0 else max(DEFAULT_CPU_DEVICES // rest, 1) * rest
    jax.config.update("jax_num_cpu_devices", n)
    return n
