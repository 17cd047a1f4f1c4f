"""A sequence-length curriculum against none: held-out loss per token seen, and time, on the shipped text.

    python benchmarks/curriculum.py --plot benchmarks/plots/curriculum.png
    python benchmarks/curriculum.py --steps 300 --seeds 0,1,2 --curriculum 64x75,128x75 train.seq_len=256

Each run trains `--config` on one device for `--steps` steps of the same batches (same seed, the same tokens
per step: a curriculum step holds the plain step's tokens in shorter windows) and evaluates the held-out
split at train.seq_len every `--eval-every` steps. Prints one JSON line per run: the held-out losses by tokens
seen, the seconds spent in steps (compiles excluded) and the mean train loss of each stage; `--plot` draws the
held-out loss against tokens seen, one line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULTS = ["train.seq_len=256", "train.batch_size=16", "train.grad_accum=1", "train.warmup_steps=20"]


def run(config: str, steps: int, eval_every: int, seed: int, curriculum: str | None, overrides: list[str]) -> dict:
    import jax

    from pjax.config_io import load_config
    from pjax.train import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, ["mesh.dp=1", "mesh.tp=1", *DEFAULTS, f"train.steps={steps}", f"train.seed={seed}",
                                   "log.every=1", f"log.eval_every={eval_every}", "log.eval_batches=8",
                                   f"log.dir={tmp}", "checkpoint.dir=null",
                                   f"data.curriculum={curriculum or 'null'}", *overrides])
        records = train(cfg, progress=False, devices=jax.devices()[:1])
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    steps_run = [r for r in records if "loss" in r and "step_time_s" in r]
    by_length: dict[int, list[float]] = {}
    for r in steps_run:
        by_length.setdefault(r["seq_len"], []).append(r["loss"])
    return {
        "curriculum": curriculum, "seed": seed, "steps": steps, "seq_len": cfg.train.seq_len,
        "tokens_per_step": tokens_per_step,
        "eval": [(r["step"] * tokens_per_step, round(r["eval_loss"], 4)) for r in records if "eval_loss" in r],
        "step_seconds": round(sum(r["step_time_s"] for r in steps_run if not r.get("includes_compile")), 2),
        "train_loss_by_length": {length: round(sum(v) / len(v), 4) for length, v in by_length.items()},
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for row in rows:
        label = row["curriculum"] or "none"
        colour = colours.setdefault(label, f"C{len(colours)}")
        tokens, losses = zip(*row["eval"])
        ax.plot([t / 1e6 for t in tokens], losses, color=colour, marker="o", ms=3, alpha=0.8,
                label=f"{label} (seed {row['seed']})")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel(f"held-out loss at {rows[0]['seq_len']} tokens")
    ax.set_title("sequence-length curriculum against none, shipped text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="debug")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--curriculum", default="64x75,128x75", help="data.curriculum of the curriculum runs")
    ap.add_argument("--plot", default=None, help="write held-out loss against tokens seen to this PNG")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = ap.parse_args()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for curriculum in (None, args.curriculum):
            rows.append(run(args.config, args.steps, args.eval_every, seed, curriculum, args.overrides))
            print(json.dumps(rows[-1]), flush=True)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
