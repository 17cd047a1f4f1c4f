"""Process start-up, before JAX's backend starts: multi-host initialisation, forced CPU devices
and the size of XLA:CPU's thread pool.

All must run before the first call that touches devices (`jax.devices()`, any computation):
after that XLA's device count and the process group are fixed.
"""
from __future__ import annotations

import os

import jax

from mesh.errors import ConfigError, first_line
from mesh.mesh import MeshConfig

DEFAULT_CPU_DEVICES = 8  # what `mesh.dp=-1` fills when there is no accelerator


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> int:
    """Join a multi-process run when asked to: explicit arguments, or a SLURM job of several tasks.

    Returns the number of processes (1 when running alone). One process per host, each seeing
    its local accelerators; under SLURM JAX finds the coordinator in the environment itself.
    """
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ
    if not (explicit or slurm):
        return 1
    if explicit:
        check_process_flags(coordinator, num_processes, process_id)
    # CPU-only multi-process runs need a collectives backend; gloo ships with jaxlib. This only
    # affects the CPU backend, so it is harmless on GPU hosts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if explicit:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id)
            return num_processes
        jax.distributed.initialize()
    except Exception as e:  # an unreachable coordinator, a refused connection, a timeout
        where = f"at {coordinator} as process {process_id} of {num_processes}" if explicit else "under SLURM"
        raise ConfigError(f"could not join the multi-process run {where} ({first_line(e)}); "
                          f"start every process with the same "
                          f"--coordinator and --num_processes and its own --process_id.") from None
    return int(os.environ["SLURM_NTASKS"])


def check_process_flags(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """One-line errors for multi-process flags that cannot work, before anything tries to connect."""
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("--coordinator, --num_processes and --process_id go together; pass all three "
                          "(e.g. --coordinator 10.0.0.1:1234 --num_processes 2 --process_id 0), or none under SLURM.")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator={coordinator} is not host:port; pass e.g. 10.0.0.1:1234.")
    if num_processes < 1:
        raise ConfigError(f"--num_processes={num_processes} is invalid; use an integer >= 1.")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process_id={process_id} is invalid for --num_processes={num_processes}; use 0 to "
                          f"{num_processes - 1}, a different one per process.")


def force_cpu_devices(mesh_cfg: MeshConfig, num_processes: int = 1) -> int:
    """Ask XLA:CPU for as many devices per process as the mesh needs (8 in all when dp=-1 fills).

    Only the CPU backend is affected: on a GPU or TPU host the accelerators stay the default
    devices, so this is safe to call unconditionally before the backend starts.
    """
    rest = mesh_cfg.pp * mesh_cfg.cp * mesh_cfg.tp
    total = mesh_cfg.dp * rest if mesh_cfg.dp > 0 else max(DEFAULT_CPU_DEVICES // rest, 1) * rest
    if total % num_processes:
        raise ConfigError(f"the mesh's {total} devices do not split evenly over {num_processes} processes; "
                          f"choose mesh sizes whose product is a multiple of the process count.")
    jax.config.update("jax_num_cpu_devices", total // num_processes)
    return total // num_processes


THREAD_POOL_ENV = "PJRT_NPROC"  # read once by XLA when the CPU client starts (`NPROC` is its fallback)


def pipeline_cpu_threads(mesh_cfg: MeshConfig, devices: int) -> int | None:
    """Size XLA:CPU's thread pools for a pipeline (pp > 1): max(cores + 1, 2 x devices) threads.

    XLA:CPU runs each forced device's launch, and the ops of a launch that may run side by side,
    on pools of max(PJRT_NPROC, devices) threads, and a thread in a collective blocks until every
    participant arrives. A pipeline stage waits for much of a tick while its neighbour computes:
    with as many threads as cores the waiting stage held a core the busy one could use (pp=2 ran
    at one core's speed), hence one thread more than the cores. And a device can wait in a
    collective on a second thread while its launch holds the first: with only `devices` threads,
    dp2 x pp2 x tp2 at 8 micro-batches deadlocked (every thread waiting, one device's next op
    queued behind them). Other layouts keep XLA's default. A value the user set is left alone.
    Returns the thread count set, or None. Must run before JAX's backend starts; meant for forced
    CPU devices (on accelerator hosts XLA may size other host pools from it too).
    """
    if mesh_cfg.pp <= 1 or THREAD_POOL_ENV in os.environ or "NPROC" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(cores + 1, 2 * devices)
    os.environ[THREAD_POOL_ENV] = str(threads)
    return threads
