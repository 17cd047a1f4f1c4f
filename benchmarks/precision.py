"""Precision presets side by side: loss on the shipped text and per-device memory of the compiled step.

    python benchmarks/precision.py                                   # debug model, 200 steps, 1 CPU device
    python benchmarks/precision.py --steps 50 --memory-config smollm-360m --memory-layout 1

For each preset, `--steps` steps of `--config` on one device (same seed, same batches) give the
train loss at the end and the held-out loss; then the step of `--memory-config` is compiled from
shapes (nothing allocated) and its argument (parameters, moments, batch), temporary and total
bytes per device are read from `memory_analysis()`. Prints one JSON line per preset.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from common import compile_step  # noqa: E402

PRESETS = ("fp32", "bf16", "bf16-lean", "fp8")


def losses(config: str, preset: str, steps: int, overrides: list[str]) -> dict[str, float]:
    import jax

    from pjax.config_io import load_config
    from pjax.train import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, ["mesh.dp=1", "mesh.tp=1", f"train.steps={steps}", "train.dtype=auto",
                                   f"log.every={steps}", f"log.eval_every={steps}", f"log.dir={tmp}",
                                   "checkpoint.dir=null", f"precision.preset={preset}", *overrides])
        records = train(cfg, progress=False, devices=jax.devices()[:1])
    train_loss = [r["loss"] for r in records if "loss" in r][-1]
    eval_loss = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    return {"train_loss": round(train_loss, 4), "eval_loss": round(eval_loss, 4)}


def memory(config: str, layout: str, preset: str) -> dict[str, float]:
    built = compile_step(config, layout, ["train.dtype=auto", f"precision.preset={preset}"])
    m = built["compiled"].memory_analysis()
    mb = lambda b: round(b / 2**20, 2)  # noqa: E731
    return {"args_mb": mb(m.argument_size_in_bytes), "temp_mb": mb(m.temp_size_in_bytes),
            "total_mb": mb(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                           - m.alias_size_in_bytes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="debug")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--memory-config", default="picotron-cpu")
    ap.add_argument("--memory-layout", default="1")
    ap.add_argument("overrides", nargs="*", help="section.key=value for the loss runs")
    args = ap.parse_args()
    for preset in args.presets.split(","):
        row = {"preset": preset, "config": args.config, "steps": args.steps,
               **losses(args.config, preset, args.steps, args.overrides),
               "memory_config": args.memory_config, **memory(args.memory_config, args.memory_layout, preset)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
