"""Peak host memory of `python -m pjax.export`, one file against shards: prints one JSON line per export.

    python benchmarks/export_memory.py                       # SmolLM-360M, fp32 (1.45 GB of weights)
    python benchmarks/export_memory.py --config smollm-135m --shards 100MB,50MB

A checkpoint of the config's shape is made first (one step at a tiny batch, on this machine's CPU) unless
--checkpoint names one. Each export runs in a process of its own; `peak_rss_mib` is that process's peak resident
memory, `baseline_rss_mib` a process that opens the checkpoint and reads its config but no parameter, so their
difference is what the export held (`models/hf_shards.py`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MEASURE = """
import resource, sys
from pjax.export import main
if sys.argv[1] == "--open":  # the baseline: the checkpoint opened and its config read, no parameter
    from pjax.checkpoint.checkpointer import Checkpointer
    with Checkpointer(sys.argv[2], read_only=True) as ckpt:
        ckpt.readable(ckpt.read_config)
    code = 0
else:
    code = main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, code)
"""


def make_checkpoint(config: str, directory: Path) -> None:
    """One training step of `config` at a tiny batch, saved to `directory`."""
    subprocess.run([sys.executable, "-m", "pjax.train", "--config", config, "--no_progress", "train.steps=1",
                    "train.seq_len=32", "train.batch_size=1", "train.grad_accum=1", "mesh.dp=1", "mesh.tp=1",
                    "train.zero=0", "log.eval_every=0", f"log.dir={directory}/log", f"checkpoint.dir={directory}/ckpt",
                    "precision.preset=fp32"], check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                   stdout=subprocess.DEVNULL)


def peak_and_seconds(args: list[str]) -> tuple[int, float]:
    """Peak resident MiB of a process running `pjax.export` with `args` (`--open DIR`: the baseline), and its
    seconds."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MEASURE, *args], check=True, capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout.split()
    if len(out) < 2 or out[-1] != "0":
        raise SystemExit(f"export failed: {' '.join(out)}")
    return int(out[-2]), round(time.perf_counter() - start, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm-360m")
    ap.add_argument("--checkpoint", default=None, help="an existing checkpoint.dir (default: make one)")
    ap.add_argument("--shards", default="100MB", help="comma-separated --max-shard-size values to measure")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            make_checkpoint(args.config, Path(tmp))
            checkpoint = f"{tmp}/ckpt"
        baseline, _ = peak_and_seconds(["--open", checkpoint])
        for shard in [None, *args.shards.split(",")]:
            out = Path(tmp, f"out-{shard}")
            extra = [] if shard is None else ["--max-shard-size", shard]
            peak, seconds = peak_and_seconds(["--checkpoint", checkpoint, "--out", str(out), *extra])
            files = sorted(out.glob("model*.safetensors"))
            print(json.dumps({"config": args.config, "max_shard_size": shard, "files": len(files),
                              "weights_mib": round(sum(f.stat().st_size for f in files) / 2**20),
                              "largest_file_mib": round(max(f.stat().st_size for f in files) / 2**20),
                              "peak_rss_mib": peak, "baseline_rss_mib": baseline, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
