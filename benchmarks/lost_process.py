"""A multi-process run on this machine: its wall time, and the time from a SIGKILL of one process to the others' exit.

    python benchmarks/lost_process.py                            # 4 processes x 2 CPU devices, --peer_timeout 30
    python benchmarks/lost_process.py --processes 2 --peer_timeout 10

Starts `python -m pjax.train` (the debug config, dp x tp over every process's devices) as `--processes` local
processes, twice: once to the end of `--steps` steps, once SIGKILLing process `--kill` when process 0 has logged
`--kill_after` steps. One JSON line each: wall seconds, exit codes, and for the second the seconds from the kill to
the last exit and the survivors' last stderr line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(tmp: Path, count: int, steps: int, peer_timeout: float) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_COORDINATOR_")) and k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return [subprocess.Popen([sys.executable, "-m", "pjax.train", "--no_progress", "--coordinator", f"127.0.0.1:{port}",
                              "--num_processes", str(count), "--process_id", str(i), "--peer_timeout", str(peer_timeout),
                              f"train.steps={steps}", "log.every=1", "log.eval_every=0", f"log.dir={tmp}/run",
                              f"data.cache_dir={tmp}/cache{i}"], cwd=REPO, env=env,
                             stdout=open(tmp / f"{i}.out", "w"), stderr=open(tmp / f"{i}.err", "w"))
            for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kill", type=int, default=2, help="the process to SIGKILL (not 0: JAX's own to report)")
    ap.add_argument("--kill_after", type=int, default=5, help="the step process 0 has logged at the kill")
    ap.add_argument("--peer_timeout", type=float, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        began = time.monotonic()
        codes = [p.wait() for p in start(tmp, args.processes, args.steps, args.peer_timeout)]
        print(json.dumps({"run": "complete", "processes": args.processes, "steps": args.steps, "exit": codes,
                          "wall_s": round(time.monotonic() - began, 1)}), flush=True)
        (tmp / "killed").mkdir()
        procs = start(tmp / "killed", args.processes, 10_000, args.peer_timeout)
        while f"step {args.kill_after}:" not in (tmp / "killed" / "0.out").read_text():
            time.sleep(0.05)
        procs[args.kill].kill()
        killed = time.monotonic()
        codes = [p.wait() for p in procs]
        last = {i: ((tmp / "killed" / f"{i}.err").read_text().strip().splitlines() or [""])[-1][:120]
                for i in range(args.processes) if i != args.kill}
        print(json.dumps({"run": "killed", "processes": args.processes, "killed": args.kill,
                          "peer_timeout_s": args.peer_timeout, "exit": codes,
                          "kill_to_last_exit_s": round(time.monotonic() - killed, 1), "last_line": last}), flush=True)


if __name__ == "__main__":
    main()
