"""Exact losses of 10 training steps per layout, to prove a refactor changes no bit.

    python benchmarks/exact_losses.py --record      # write benchmarks/exact_losses.json
    python benchmarks/exact_losses.py               # rerun and compare with it, bit for bit
    python benchmarks/exact_losses.py --layouts cp2-ring,pp2-zb_h1

Each layout trains 10 steps through `pjax.train.train` (the real data pipeline, fp32, CPU) in a
process of its own with as many forced CPU devices as its mesh, and its losses are kept as
float hex strings. The figures hold for one machine kind and one jax version: record before a
change and check after it on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "exact_losses.json")
STEPS = 10

# name: (config, overrides)
LAYOUTS = {
    "debug": ("debug", []),
    "picotron-1": ("picotron-cpu", []),
    "picotron-dp2-tp2": ("picotron-cpu", ["mesh.dp=2", "mesh.tp=2"]),
    "picotron-pp2-1f1b": ("picotron-cpu", ["mesh.pp=2", "pipeline.schedule=1f1b"]),
    "picotron-pp2-zb_h1": ("picotron-cpu", ["mesh.pp=2", "pipeline.schedule=zb_h1"]),
    "picotron-cp2-ring": ("picotron-cpu", ["mesh.cp=2", "context.strategy=ring"]),
    "picotron-cp2-ulysses": ("picotron-cpu", ["mesh.cp=2", "context.strategy=ulysses"]),
    "picotron-tp2-sp": ("picotron-cpu", ["mesh.tp=2", "train.sequence_parallel=true"]),
    "mixtral-tiny-dp2-tp2": ("mixtral-tiny", ["mesh.dp=2", "mesh.tp=2"]),
}


def run_one(name: str) -> list[str]:
    """Train one layout for STEPS steps in this process; its losses as float hex strings."""
    config, overrides = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        from pjax.config_io import load_config

        cfg = load_config(config, overrides + [f"train.steps={STEPS}", "log.every=1", "log.eval_every=0",
                                               f"log.dir={tmp}", "checkpoint.dir=null", "train.dtype=float32"])
        devices = cfg.mesh.dp * cfg.mesh.pp * cfg.mesh.cp * cfg.mesh.tp if cfg.mesh.dp > 0 else 8
        import jax

        from mesh.distributed import pipeline_cpu_threads

        jax.config.update("jax_num_cpu_devices", devices)
        pipeline_cpu_threads(cfg.mesh, devices)
        from pjax.train import train

        records = train(cfg, progress=False)
    return [float(r["loss"]).hex() for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help=f"write {os.path.basename(RECORD)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return
    names = args.layouts.split(",")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    found = {}
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        found[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps({"layout": name, "losses": [float.fromhex(h) for h in found[name]]}), flush=True)
    if args.record:
        old = json.load(open(RECORD)) if os.path.exists(RECORD) else {}
        with open(RECORD, "w") as f:
            json.dump({**old, **found}, f, indent=1)
        return
    expected = json.load(open(RECORD))
    differ = [n for n in names if expected.get(n) != found[n]]
    print(json.dumps({"bit_identical": not differ, "differ": differ}))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
