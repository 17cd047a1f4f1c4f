"""Process start-up, before JAX's backend starts: multi-host initialisation, forced CPU devices
and the size of XLA:CPU's thread pool.

All must run before the first call that touches devices (`jax.devices()`, any computation):
after that XLA's device count and the process group are fixed.
"""
from __future__ import annotations

import os
import re

import jax

from mesh.errors import ConfigError, first_line, shown
from mesh.mesh import MeshConfig

DEFAULT_CPU_DEVICES = 8  # what `mesh.dp=-1` fills when there is no accelerator


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> int:
    """Join a multi-process run when asked to: explicit arguments, or an srun step of several tasks.

    Returns the number of processes (1 when running alone). One process per host, each seeing
    all its local accelerators. Precedence: explicit arguments name the coordinator; under SLURM
    their count and index must agree with SLURM_NTASKS and SLURM_PROCID (srun started exactly
    those processes, so any other count would wait for processes that never come).
    """
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit:
        check_process_flags(coordinator, num_processes, process_id)
    slurm = slurm_process()
    if slurm and explicit:
        check_flags_match_slurm(num_processes, process_id, *slurm[1:])
    elif slurm:
        coordinator, num_processes, process_id = slurm
    elif not explicit:
        return 1
    # CPU-only multi-process runs need a collectives backend; gloo ships with jaxlib. This only
    # affects the CPU backend, so it is harmless on GPU hosts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        # "deactivate": with every value given, JAX's own SLURM/Open MPI detection would still set
        # local_device_ids to SLURM_LOCALID, leaving each process one GPU (JAX's one process per
        # GPU); pjax runs one process per host over all its GPUs.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, cluster_detection_method="deactivate")
    except Exception as e:  # an unreachable coordinator, a refused connection, a timeout
        fix = ("SLURM's environment named these: check that every task is in the same srun step and that the "
               "port is free (JAX_COORDINATOR_PORT picks another)" if slurm and not explicit else
               "start every process with the same --coordinator and --num_processes and its own --process_id")
        raise ConfigError(f"could not join the multi-process run at {coordinator} as process {process_id} of "
                          f"{num_processes} ({first_line(e)}); {fix}.") from None
    return num_processes


SLURM_BASE_PORT, SLURM_PORTS = 61440, 4096  # JAX's rule: port = 61440 + SLURM_JOB_ID mod 4096


def slurm_process() -> tuple[str, int, int] | None:
    """(coordinator host:port, process count, this process's index) in an srun step of several
    tasks; None outside SLURM or with one task.

    The same values JAX's own detection (jax/_src/clusters/slurm_cluster.py) derives: the
    coordinator is the step's first node, on port 61440 + SLURM_JOB_ID mod 4096 unless
    JAX_COORDINATOR_PORT names one.
    """
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return None
    tasks, rank = slurm_int("SLURM_NTASKS"), slurm_int("SLURM_PROCID")
    if tasks <= 1:
        return None
    nodes = os.environ.get("SLURM_STEP_NODELIST", "")
    if not nodes:  # e.g. the batch script itself, which runs once whatever --ntasks says
        raise ConfigError(f"SLURM_NTASKS={tasks} but this process is not in an srun step (no SLURM_STEP_NODELIST); "
                          f"start every task with `srun python -m pjax.train ...`, or pass --coordinator, "
                          f"--num_processes and --process_id.")
    if not 0 <= rank < tasks:
        raise ConfigError(f"SLURM_PROCID={rank} is invalid for SLURM_NTASKS={tasks}; SLURM's environment is "
                          f"inconsistent (was it copied from another step?).")
    port = os.environ.get("JAX_COORDINATOR_PORT") or str(SLURM_BASE_PORT + slurm_int("SLURM_JOB_ID") % SLURM_PORTS)
    return f"{first_slurm_host(nodes)}:{port}", tasks, rank


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'n001', 'n001,x2', 'n[001-015],x2', 'n[001,007-015]' -> 'n001'."""
    match = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodelist)
    return match.group(1) + (match.group(2) or "")


def slurm_int(name: str) -> int:
    """A SLURM variable that must hold a whole number, or a one-line error naming it."""
    value = os.environ.get(name)
    if value is None or not value.strip().isdigit():
        said = " is not set" if value is None else f"={shown(value)} is not a whole number"
        raise ConfigError(f"{name}{said}; srun sets it in every task, so start pjax with srun or unset the "
                          f"SLURM_* variables.")
    return int(value)


def check_flags_match_slurm(num_processes: int, process_id: int, tasks: int, rank: int) -> None:
    """Under srun, explicit flags may move the coordinator but not change the processes SLURM started."""
    if num_processes != tasks or process_id != rank:
        raise ConfigError(f"--num_processes={num_processes} --process_id={process_id} disagree with SLURM's "
                          f"SLURM_NTASKS={tasks} SLURM_PROCID={rank}; under srun drop the flags (SLURM's "
                          f"environment is enough) or make them match.")


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
