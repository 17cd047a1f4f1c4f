"""Compressed gradient reduction (`train.grad_compression`): bytes on the wire, convergence, and a time model.

    python benchmarks/grad_compression.py --plot benchmarks/plots/compression.png
    python benchmarks/grad_compression.py --parts bytes --layouts dp8,dp8-zero1,dp2-tp4,dp2-pp2-tp2

1. Bytes: each layout's step compiled from shapes on 8 forced CPU devices per mode, the collectives read from
   the HLO: what one device sends per step by kind, each op's bytes times a ring algorithm's share for its
   group (`pjax.observe.hlo.link_factor`; `comm.py` counts operands instead, which halves an all-reduce's traffic).
2. Convergence: `--config` trained `--steps` steps on `--dp` data replicas per mode (same seed, same batches),
   the held-out loss every `--eval-every` steps. A mode `diloco:H` is DiLoCo (`train.local_steps=H`), whose
   bytes are its inner and outer steps compiled apart, inner + outer / H per step; `diloco:H+int8` sends
   its outer average in int8 (or bf16, powersgd) with error feedback; `streaming:H/P/tau` is streaming DiLoCo,
   P fragments (`train.diloco_fragments`) landing tau steps after their send (`train.diloco_overlap`).
3. A time model: the dp reduction of a real model (`--model`, e.g. smollm-360m) on 8 replicas at each link
   speed, bytes / bandwidth, against one H100's compute time for the step at the MFU measured there
   (benchmarks/README.md, "One GPU"), assuming none of it overlaps.
Prints one JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODES = ("none", "bf16", "int8", "powersgd", "powersgd:4")  # powersgd:R = train.powersgd_rank=R


def mode_overrides(mode: str) -> list[str]:
    """The config keys of a mode name ('powersgd:4' -> powersgd at rank 4, 'diloco:16' -> DiLoCo with H=16,
    'diloco:16+int8' -> its outer average in int8)."""
    name, _, rank = mode.partition(":")
    if name in ("diloco", "streaming"):
        steps, payload = diloco_mode(mode)
        parts, tau = streaming_mode(mode)
        return [f"train.local_steps={steps}", *([f"train.grad_compression={payload}"] if payload != "none" else []),
                *([f"train.diloco_fragments={parts}", f"train.diloco_overlap={tau}"] if name == "streaming" else [])]
    return [f"train.grad_compression={name}", *([f"train.powersgd_rank={rank}"] if rank else [])]


def diloco_mode(mode: str) -> tuple[int, str]:
    """(H, the outer average's payload) of a mode 'diloco:H', 'diloco:H+int8' or 'streaming:H/P/tau[+int8]'."""
    steps, _, payload = mode.partition(":")[2].partition("+")
    return int(steps.split("/")[0]), payload or "none"


def streaming_mode(mode: str) -> tuple[int, int]:
    """(fragments, overlap) of a mode 'streaming:H/P/tau' (streaming DiLoCo); (1, 0) for 'diloco:H'."""
    if not mode.startswith("streaming:"):
        return 1, 0
    _, parts, tau = mode.partition(":")[2].partition("+")[0].split("/")
    return int(parts), int(tau)


LINKS = {"10 Gb/s Ethernet": 10e9 / 8, "100 Gb/s InfiniBand": 100e9 / 8, "400 Gb/s InfiniBand": 400e9 / 8,
         "NVLink (450 GB/s)": 450e9}


def reduction_bytes(config: object, replicas: int, mode: str) -> float:
    """Bytes one replica sends per step for the gradient sum over `replicas`: (n-1)/n of the payload twice (a
    reduce-scatter then an all-gather: a ring all-reduce's volume, and the two-phase compressed sum's alike);
    PowerSGD all-reduces each matrix's P [rows, r] and Q [cols, r] in fp32 and each vector whole."""
    import jax

    from models import llama
    from pjax.parallel import powersgd
    from pjax.parallel.compression import bytes_per_value

    name, _, rank = mode.partition(":")
    ring = 2 * (replicas - 1) / replicas
    shapes = jax.eval_shape(lambda: llama.init_params(config.model, jax.random.key(0)))
    if name == "diloco":  # the parameter average in its payload (fp32 without one), once every H steps
        steps, payload = diloco_mode(mode)
        return ring * bytes_per_value(payload) * sum(s.size for s in jax.tree.leaves(shapes)) / steps
    names = jax.tree.leaves(llama.param_logical_axes(config.model), is_leaf=lambda x: isinstance(x, tuple))
    total = 0.0
    for n, s in zip(names, jax.tree.leaves(shapes)):
        if name != "powersgd" or powersgd.split(n) is None:
            total += s.size * (bytes_per_value(name) if name != "powersgd" else 4.0)
            continue
        q = powersgd.q_shape(s.shape, n, int(rank or 1))  # [*layers, cols, r]; P is [*layers, rows, r]
        cols_all = math.prod(q[:-1])
        total += 4.0 * q[-1] * (s.size // q[-2] + cols_all)
    return ring * total


def measure_bytes(config: str, layouts: list[str], overrides: list[str], modes: list[str]) -> list[dict]:
    """Per layout and mode, the bytes each device sends per step, by collective kind, from the compiled HLO."""
    from common import compile_step
    from comm import runs_per_appearance
    from pjax.observe.hlo import collective_stats, device_groups, link_factor

    rows = []
    for layout in layouts:
        for mode in modes:
            built = compile_step(config, layout, [*overrides, *mode_overrides(mode)])
            runs, n = runs_per_appearance(built), built["mesh"].devices.size

            def scale(kind: str, line: str) -> float:
                groups = device_groups(line, n)
                group = 2 if kind == "collective-permute" else max(len(g) for g in groups)
                return runs(kind, line) * link_factor(kind, group)

            if mode.startswith(("diloco:", "streaming:")):
                row = {"layout": layout, "mode": mode, **_diloco_bytes(built, scale, diloco_mode(mode)[0])}
            else:
                stats = collective_stats(built["compiled"].as_text(), scale=scale)
                sent = {k: round(v["bytes"]) for k, v in stats.items() if v["bytes"]}
                row = {"layout": layout, "mode": mode, "sent_bytes_per_device": sum(sent.values()), "by_kind": sent}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _diloco_bytes(built: dict, scale: Any, local_steps: int) -> dict:
    """DiLoCo's bytes: its inner step and its outer step compiled apart (the step runs the outer one under a
    conditional, once every H steps), and their mean per step: inner + outer / H. Streaming DiLoCo's outer step
    is one fragment's, P of them every H steps: the same mean, 1/P of the peak."""
    import jax
    import jax.numpy as jnp

    from pjax.observe.hlo import collective_stats
    from pjax.parallel.streaming import StreamingDiLoCo

    trainer, state = built["trainer"], built["trainer"].abstract_state()
    diloco, parts = trainer.diloco, trainer.tc.diloco_fragments
    with jax.set_mesh(trainer.mesh):
        own = {k: state.local[k] for k in ("params", "opt_state")}
        inner = jax.jit(diloco.inner_step).lower(own, trainer.abstract_batch()).compile()
        if isinstance(diloco, StreamingDiLoCo):
            first = jnp.zeros((), jnp.int32)
            fragment = lambda p, o, r, lc: diloco.outer_fragment(p, o, r, diloco.slices(lc, first), first)  # noqa: E731
            outer = jax.jit(fragment).lower(state.params, state.opt_state, state.residual,
                                            state.local["params"]).compile()
        else:
            outer = jax.jit(diloco.synchronise).lower(state.params, state.opt_state, state.local,
                                                      state.residual).compile()
    inner_b, outer_b = (round(sum(v["bytes"] for v in collective_stats(c.as_text(), scale=scale).values()))
                        for c in (inner, outer))
    return {"sent_bytes_per_device": round(inner_b + outer_b * parts / local_steps), "inner_step_bytes": inner_b,
            "outer_step_bytes": outer_b}


def converge(config: str, steps: int, eval_every: int, dp: int, mode: str, overrides: list[str]) -> dict:
    """One training run in a process of its own (its own forced devices), the held-out losses by step."""
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import grad_compression; "
            f"print(json.dumps(grad_compression._train({config!r}, {steps}, {eval_every}, {dp}, {mode!r}, {overrides!r})))")
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={dp}"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _train(config: str, steps: int, eval_every: int, dp: int, mode: str, overrides: list[str]) -> dict:
    import jax

    from pjax.config_io import load_config
    from pjax.train import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, [f"mesh.dp={dp}", "mesh.tp=1", f"train.steps={steps}", "log.every=1",
                                   f"log.eval_every={eval_every}", "log.eval_batches=8", f"log.dir={tmp}",
                                   "checkpoint.dir=null", *mode_overrides(mode), *overrides])
        records = train(cfg, progress=False, devices=jax.devices()[:dp])
    return {"mode": mode, "dp": dp, "steps": steps,
            "eval": [(r["step"], round(r["eval_loss"], 4)) for r in records if "eval_loss" in r],
            "final_train_loss": round([r["loss"] for r in records if "loss" in r][-1], 4)}


def time_model(model: str, replicas: int, step_s: float) -> list[dict]:
    """The dp reduction's seconds per step at each link speed and mode, next to the step's compute."""
    from pjax.config_io import load_config

    config = load_config(model, [])
    modes = (*MODES, "diloco:30", "diloco:30+int8")
    sent = {mode: reduction_bytes(config, replicas, mode) for mode in modes}
    rows = []
    for link, bandwidth in LINKS.items():
        row = {"model": model, "replicas": replicas, "link": link, "compute_s": step_s}
        for mode in modes:
            row[f"{mode}_s"] = round(sent[mode] / bandwidth, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps, losses = zip(*run["eval"])
        ax.plot(steps, losses, marker="o", ms=3, label=f"{run['mode']} (dp{run['dp']})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.set_title("train.grad_compression, shipped text, same seed and batches")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu", help="the config whose steps are compiled for bytes")
    ap.add_argument("--layouts", default="dp8,dp8-zero1,dp2-tp4,dp2-cp2-tp2,dp2-pp2-tp2")
    ap.add_argument("--train-config", default="debug")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--model", default="smollm-360m", help="the time model's parameter count")
    ap.add_argument("--step-s", type=float, default=0.492,
                    help="one H100's step for --model (SmolLM-360M, 32 x 2048 tokens: 492 ms, benchmarks/README.md)")
    ap.add_argument("--parts", default="bytes,time,converge", help="which of bytes, time, converge to run")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes to measure and train")
    ap.add_argument("--train-overrides", default="", help="comma-separated key=value for the convergence runs")
    ap.add_argument("--plot", default=None)
    ap.add_argument("overrides", nargs="*", default=["train.grad_accum=2"], help="for the byte counts")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "bytes" in parts:
        measure_bytes(args.config, args.layouts.split(","), args.overrides, args.modes.split(","))
    if "time" in parts:
        time_model(args.model, 8, args.step_s)
    if "converge" not in parts:
        return
    train_overrides = ["train.seq_len=256", "train.batch_size=16", "train.warmup_steps=20",
                       *filter(None, args.train_overrides.split(","))]
    runs = [converge(args.train_config, args.steps, args.eval_every, args.dp, m, train_overrides)
            for m in args.modes.split(",")]
    for run in runs:
        print(json.dumps(run), flush=True)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
