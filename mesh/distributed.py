"""Process start-up, before the first call that touches devices fixes XLA's device count and the process group:
multi-host initialisation, forced CPU devices, XLA:CPU's thread pool size."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import sys
import threading
from typing import Any, Iterator

import jax

from mesh import watchdog
from mesh.errors import ConfigError, first_line, shown
from mesh.mesh import MeshConfig

DEFAULT_CPU_DEVICES = 8  # what `mesh.dp=-1` fills when there is no accelerator


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, join_timeout: float = 300, peer_timeout: float = 30) -> int:
    """Join a multi-process run (explicit flags or a multi-task srun step), one process per host; the process count.
    Every process must arrive within `join_timeout` seconds; once joined, one silent for `peer_timeout` seconds
    ends the run (`mesh.watchdog`)."""
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
    watchdog.check_timeout(join_timeout, "--join_timeout")
    watchdog.check_timeout(peer_timeout, "--peer_timeout")
    if process_id == 0:
        check_port_free(os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{coordinator.rpartition(':')[2]}")
    # CPU-only multi-process runs need a collectives backend (CPU only, harmless on GPU hosts).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        with join_deadline(join_timeout, coordinator, num_processes, process_id):
            # JAX's SLURM detection would leave each process one GPU; pjax runs one per host. JAX's own timeouts
            # end the process with a fatal log: pjax's (the deadline, the watchdog) come first, in one line.
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id, cluster_detection_method="deactivate",
                                       initialization_timeout=int(join_timeout) + 60,
                                       heartbeat_timeout_seconds=max(watchdog.JAX_HEARTBEAT_FLOOR_S,
                                                                     int(3 * peer_timeout)))
    except Exception as e:
        fix = ("check that all tasks share one srun step and a free port (JAX_COORDINATOR_PORT)" if slurm and not
               explicit else "give all processes the same --coordinator and --num_processes, each its own --process_id")
        raise ConfigError(f"process {process_id} of {num_processes} could not join {coordinator} "
                          f"({first_line(e, 30)}): {fix}.") from None
    watchdog.start(distributed_client(), process_id, num_processes, peer_timeout)
    return num_processes


def distributed_client() -> Any:
    """JAX's coordination-service client of this process (private to JAX; Orbax reads it the same way)."""
    from jax._src.distributed import global_state

    return global_state.client


@contextlib.contextmanager
def join_deadline(seconds: float, coordinator: str, count: int, index: int) -> Iterator[None]:
    """One line and the end of this process when not every process has joined within `seconds`."""
    def give_up() -> None:
        print(f"error: process {index} of {count} waited {seconds:g} s at {coordinator} for the others to join: "
              f"start all {count} with the same coordinator, or raise --join_timeout (docs/gpu_pods.md).",
              file=sys.stderr, flush=True)
        os._exit(2)  # JAX's connect cannot be interrupted, and its own timeout aborts with a stack trace

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_port_free(bind_address: str) -> None:
    """One line when the port process 0's coordination service binds is taken (its server would crash)."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a closed socket's port is free
        try:
            probe.bind((host, int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # e.g. no IPv6 here: the service reports its own failure
            raise ConfigError(f"the coordinator's port {port} is already taken on this host ({bind_address}); "
                              f"stop what holds it or choose another port (--coordinator host:PORT, or "
                              f"JAX_COORDINATOR_PORT under SLURM).") from None


SLURM_BASE_PORT, SLURM_PORTS = 61440, 4096  # JAX's rule: port = 61440 + SLURM_JOB_ID mod 4096


def slurm_process() -> tuple[str, int, int] | None:
    """(coordinator host:port, process count, index) of a multi-task srun step, as JAX derives them; else None."""
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return None
    tasks, rank = slurm_int("SLURM_NTASKS"), slurm_int("SLURM_PROCID")
    if tasks <= 1:
        return None
    nodes = os.environ.get("SLURM_STEP_NODELIST", "")
    if not nodes:  # e.g. the batch script itself
        raise ConfigError(f"SLURM_NTASKS={tasks} but this process is in no srun step (no SLURM_STEP_NODELIST); "
                          f"start the tasks with `srun python -m pjax.train ...`, or pass --coordinator, "
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
    """Ask XLA:CPU for the devices per process the mesh needs (harmless on accelerator hosts)."""
    rest = mesh_cfg.pp * mesh_cfg.cp * mesh_cfg.tp
    total = mesh_cfg.dp * rest if mesh_cfg.dp > 0 else max(DEFAULT_CPU_DEVICES // rest, 1) * rest
    if total % num_processes:
        raise ConfigError(f"the mesh's {total} devices do not split evenly over {num_processes} processes; "
                          f"choose mesh sizes whose product is a multiple of the process count.")
    jax.config.update("jax_num_cpu_devices", total // num_processes)
    return total // num_processes


THREAD_POOL_ENV = "PJRT_NPROC"  # `NPROC` is its fallback


def pipeline_cpu_threads(mesh_cfg: MeshConfig, devices: int) -> int | None:
    """Size XLA:CPU's thread pools for a pipeline, max(cores + 1, 2 x devices), before JAX's backend starts,
    unless the user set them (ARCHITECTURE.md, "Pipelines on forced CPU devices"); the count set, or None."""
    if mesh_cfg.pp <= 1 or THREAD_POOL_ENV in os.environ or "NPROC" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(cores + 1, 2 * devices)
    os.environ[THREAD_POOL_ENV] = str(threads)
    return threads
