"""Multi-process runs the way a pod runs them: `python -m pjax.train` as 4 processes x 2 CPU devices (gloo between
them, each process a "host"), started by a faked srun step or the multi-host flags. A few, small runs: each costs
the start-up and compile of 4 processes on this machine's 2 cores."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax

from pjax.config_io import load_config
from test_checkpoint import committed_steps
from pjax.train import train

REPO = Path(__file__).resolve().parents[1]
PROCESSES = 4
# The suite's XLA:CPU compile options, without its forced device count: each process forces its own.
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
LOGGED = ["log.every=1", "log.eval_every=0"]


def process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without the launcher's SLURM or coordinator settings, on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_COORDINATOR_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": XLA_FLAGS, **(extra or {})}


def free_port(low: int = 1024, high: int = 65536) -> int:
    """A port free on the loopback address, at random in [low, high) so that suites side by side do not meet."""
    import random

    for port in random.sample(range(low, high), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1} on 127.0.0.1")


def start(tmp: Path, name: str, count: int, args: list[str], srun=None, of: int | None = None,
          own=lambda i: []) -> list[subprocess.Popen]:
    """`count` processes of `python -m pjax.train`, as tasks of a faked srun step (`srun(i)`: task i's environment)
    or with the multi-host flags for a run of `of` (default `count`) processes, process i's `own(i)` overrides
    last; output in tmp/name.{i}.out, .err."""
    port = free_port()
    procs = []
    for i in range(count):
        flags = [] if srun else ["--coordinator", f"127.0.0.1:{port}", "--num_processes", str(of or count),
                                 "--process_id", str(i)]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pjax.train", "--no_progress", *flags, *args, f"log.dir={tmp}/{name}",
             f"data.cache_dir={tmp}/cache{i}", *own(i)], cwd=REPO, env=process_env(srun(i) if srun else None),
            stdout=open(tmp / f"{name}.{i}.out", "w"), stderr=open(tmp / f"{name}.{i}.err", "w")))
    return procs


def srun_step(count: int):
    """Task i's environment in a faked srun step of `count` tasks on this machine: the coordinator at JAX's SLURM
    port for the job id (a free one, bound on the loopback address)."""
    port = free_port(61440)
    step = {"SLURM_JOB_ID": str(4096 * 7 + port - 61440), "SLURM_NTASKS": str(count),
            "SLURM_STEP_NODELIST": "127.0.0.1", "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}"}
    return lambda i: {**step, "SLURM_PROCID": str(i), "SLURM_LOCALID": "0"}


def wait(procs: list[subprocess.Popen], timeout: float = 600) -> list[int]:
    """Each process's exit status (the rest killed if one overruns)."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            p.kill()


def output(tmp: Path, name: str, i: int, stream: str = "out") -> str:
    return (tmp / f"{name}.{i}.{stream}").read_text()


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "tokens_per_sec" in r}


def one_process(tmp: Path, name: str, overrides: list[str]) -> list[float]:
    """The same run in this process on its 8 devices: the reference."""
    cfg = load_config("debug", [*overrides, *LOGGED, f"log.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache"])
    return [r["loss"] for r in train(cfg, progress=False, devices=jax.devices())]


def close(got: dict[int, float], reference: list[float], steps) -> float:
    """The largest difference over `steps` (1-based) between a multi-process run's losses and the reference's."""
    assert sorted(got) == list(steps), (sorted(got), list(steps))
    return max(abs(got[s] - reference[s - 1]) for s in steps)


# gloo's all-reduce sums in another order than in-process collectives: the losses are ~1e-6 apart, not bit for bit.
GLOO_TOLERANCE = 1e-5

DP_TP = ["mesh.dp=4", "mesh.tp=2", "train.steps=3"]


def test_srun_step_of_four_tasks_trains_dp_tp_like_one_process(tmp_path):
    """Four tasks of a faked srun step (no multi-host flags) find the coordinator by JAX's rule (first node of
    SLURM_STEP_NODELIST, port from SLURM_JOB_ID), place tp inside each 2-device host and dp across them, and
    give the losses of one process with 8 devices."""
    procs = start(tmp_path, "slurm", PROCESSES, [*DP_TP, *LOGGED], srun_step(PROCESSES))
    assert wait(procs) == [0] * PROCESSES, output(tmp_path, "slurm", 0, "err")[-2000:]
    first = output(tmp_path, "slurm", 0)
    assert "step 3:" in first and all("step 3:" not in output(tmp_path, "slurm", i) for i in range(1, PROCESSES))
    assert "tp=2 over 8 cpu devices; across hosts: dp" in first, first
    reference = one_process(tmp_path, "single", DP_TP)
    assert close(logged_losses(tmp_path / "slurm"), reference, range(1, 4)) <= GLOO_TOLERANCE


# dp 4 x pp 2 (1F1B) with HSDP: ZeRO-1 in groups of 2 replicas, 2 copies. Every run is planned as the 12-step run.
CHAIN = ["mesh.dp=4", "mesh.pp=2", "mesh.tp=1", "train.zero=1", "train.zero_shard=2", "train.steps=12",
         "train.schedule_steps=12", "checkpoint.every=2", "checkpoint.keep=8"]


def test_a_lost_process_stops_the_run_in_one_line_and_its_checkpoint_resumes_anywhere(tmp_path):
    """One process writes a checkpoint; 4 tasks of an srun step (dp x pp with HSDP) resume it until task 2 is
    SIGKILLed; the other 3 stop within 60 s with one line naming it; the last checkpoint the 4 committed resumes on
    2 tasks and on 1 process, and every run's losses are the uninterrupted single process's."""
    reference = one_process(tmp_path, "reference", [*CHAIN, f"checkpoint.dir={tmp_path}/reference_ckpt"])
    shutil.copytree(tmp_path / "reference_ckpt" / "2", tmp_path / "four_ckpt" / "2")
    procs = start(tmp_path, "four", PROCESSES, [*CHAIN, *LOGGED, f"checkpoint.dir={tmp_path}/four_ckpt",
                                                "--peer_timeout", "10"], srun_step(PROCESSES))
    deadline = time.monotonic() + 300
    while "step 7:" not in output(tmp_path, "four", 0) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), output(tmp_path, "four", 0, "err")[-2000:]
        time.sleep(0.05)
    procs[2].kill()
    killed = time.monotonic()
    codes = wait(procs, timeout=60)
    print(f"SIGKILL to the last process's exit: {time.monotonic() - killed:.1f} s")
    assert codes == [1, 1, -9, 1], codes
    for i in (0, 1, 3):
        err = output(tmp_path, "four", i, "err")
        assert err.startswith("error: process 2 of 4 was lost: its beat stopped for 10 s") and err.count("\n") == 1, err
    steps = committed_steps(tmp_path / "four_ckpt")
    last = steps[-1]
    assert last >= 4, steps  # step 7 ran: the save at step 6 began, after step 4's had committed
    four = logged_losses(tmp_path / "four")
    assert close({s: four[s] for s in range(3, last + 1)}, reference, range(3, last + 1)) <= GLOO_TOLERANCE

    shutil.copytree(tmp_path / "four_ckpt", tmp_path / "one_ckpt")
    assert wait(start(tmp_path, "four", 2, [*CHAIN, *LOGGED, f"checkpoint.dir={tmp_path}/four_ckpt"],
                      srun_step(2))) == [0, 0]
    resumed = logged_losses(tmp_path / "four")  # the records past `last` the stopped run logged are dropped
    assert close({s: resumed[s] for s in range(last + 1, 13)}, reference, range(last + 1, 13)) <= GLOO_TOLERANCE
    assert sorted(resumed) == list(range(3, 13))
    alone = one_process(tmp_path, "one", [*CHAIN, f"checkpoint.dir={tmp_path}/one_ckpt"])
    assert max(abs(a - b) for a, b in zip(alone, reference[last:])) <= GLOO_TOLERANCE and len(alone) == 12 - last


def test_a_taken_port_a_missing_process_or_one_process_s_error_is_one_line_in_bounded_time(tmp_path):
    """Process 0 finds its coordinator port taken before its server would crash; 2 of 3 processes give up after
    --join_timeout; an error of process 0's own (its data.cache_dir) stops the other 3, each naming it, and
    process 0, which holds the coordination service, leaves last."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "pjax.train", "--coordinator", f"127.0.0.1:{port}",
                                "--num_processes", "2", "--process_id", "0"], cwd=REPO, env=process_env(),
                               capture_output=True, text=True, timeout=120)
    assert taken.returncode == 2 and taken.stderr.count("\n") == 1, taken.stderr
    assert f"the coordinator's port {port} is already taken on this host" in taken.stderr
    began = time.monotonic()
    procs = start(tmp_path, "missing", 2, ["--join_timeout", "3"], of=3)
    assert wait(procs, timeout=120) == [2, 2]
    assert time.monotonic() - began < 60
    for i in range(2):
        err = output(tmp_path, "missing", i, "err")
        assert err.startswith(f"error: process {i} of 3 waited 3 s at 127.0.0.1:") and err.count("\n") == 1, err
    procs = start(tmp_path, "failing", PROCESSES, ["--peer_timeout", "10"],
                  own=lambda i: [] if i else ["data.cache_dir=/proc/no-such-dir"])  # no directory can be made there
    assert wait(procs, timeout=120) == [2, 1, 1, 1]
    assert output(tmp_path, "failing", 0, "err").startswith("error: data.cache_dir=/proc/no-such-dir is not a writable")
    for i in range(1, PROCESSES):
        err = output(tmp_path, "failing", i, "err")
        assert err.startswith("error: process 0 of 4 stopped on an error of its own") and err.count("\n") == 1, err
