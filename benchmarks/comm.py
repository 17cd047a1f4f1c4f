"""Communication per training step, read from the compiled HLO, next to the analytic minimum.

    python benchmarks/comm.py                                   # picotron-cpu shape, several layouts
    python benchmarks/comm.py --layouts dp8,dp2-tp4 --config debug

Counts every collective per step (ops inside scans multiplied by their trip count, see
`pjax/observe/hlo.py`) and its bytes per device (the operand an all-reduce or permute moves, the gathered
result of an all-gather), next to the analytic minimum per device for the layout, mechanism by
mechanism (`pjax.plan.estimate.minimum_bytes`, whose docstring has the formulas; the planner
ranks layouts with the same floor before it compiles them).
Pipelines: a tick's forward, backward, loss and transfers are loops of zero or one trip, which
the HLO shows once per tick; their collectives are counted as often as the schedule table runs
them (`pipeline.table.scope_runs`, averaged over devices), and a permute's bytes
as the average over devices of what arrives (a pipeline's last stage receives no activation).
A layout is flagged when XLA moves more than 10% above that (e.g. gathered logits or weights,
or a gradient reduced once per micro-batch instead of once per step). All compiles are AOT from
shapes on 8 forced CPU devices: no data, seconds per layout.

On a machine with one GPU, `--mock-gpus 8` compiles the same steps for 8 mocked one-GPU hosts
(JAX's mock GPU topology: XLA:GPU's passes and scheduler, NCCL mocked). Loading the program onto
mocked devices hangs, so take the HLO from XLA's dump (benchmarks/README.md says how).
`--dump DIR` keeps each compiled module's text; `--from-hlo DIR` reads such texts back (on any
machine) instead of compiling.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from common import compile_step, layout_config  # noqa: E402


def analytic_minimum(cfg, mesh) -> dict[str, float]:
    """Minimum bytes per device per step, by mechanism (fp32 activations and gradients):
    `pjax.plan.estimate.minimum_bytes`, the planner's own floor."""
    from pjax.plan.estimate import minimum_bytes
    from pjax.plan.layouts import Layout

    sizes = {a: mesh.shape[a] for a in ("dp", "pp", "cp", "tp")}
    layout = Layout(**sizes, zero=cfg.train.zero, grad_accum=cfg.train.grad_accum, schedule=cfg.pipeline.schedule,
                    virtual_stages=cfg.pipeline.virtual_stages, sequence_parallel=cfg.train.sequence_parallel,
                    context=cfg.context.strategy)
    return minimum_bytes(cfg, layout, act_bytes=4)


def runs_per_appearance(built: dict) -> Callable[[str, str], float]:
    """How many times per step (averaged over devices) a collective runs each time the HLO shows it:
    1, except inside a pipeline tick's conditional parts (`pipeline.table.tick_runs`), and for
    permutes whose pairs leave some devices out."""
    from pjax.observe.hlo import device_groups
    from pjax.parallel.pipeline.table import tick_runs

    mesh, cfg = built["mesh"], built["cfg"]
    devices, pp = mesh.devices.size, mesh.shape["pp"]
    in_tick = tick_runs(cfg.pipeline, pp, cfg.train.grad_accum, mesh.shape["cp"] > 1) if pp > 1 else None

    def runs(kind: str, line: str) -> float:
        factor = in_tick(kind, line) if in_tick else 1.0
        if kind == "collective-permute":
            factor *= len(device_groups(line, devices)) / devices
        return factor
    return runs


def measure(config: str, layout: str, overrides: list[str], dump: str | None = None,
            from_hlo: str | None = None) -> dict:
    """One layout's row: compiled here, or read from `from_hlo`/<layout>.hlo.txt (a `--dump`)."""
    from pjax.observe.hlo import async_overlap, collective_stats

    if from_hlo:
        cfg, mesh = layout_config(config, layout, overrides)
        built = {"cfg": cfg, "mesh": mesh}
        with open(os.path.join(from_hlo, f"{layout}.hlo.txt")) as f:
            text = f.read()
    else:
        built = compile_step(config, layout, overrides)
        text = built["compiled"].as_text()
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{layout}.hlo.txt"), "w") as f:
            f.write(text)
    stats = collective_stats(text, scale=runs_per_appearance(built))
    stats = {kind: {"count": round(s["count"], 2), "bytes": round(s["bytes"])} for kind, s in stats.items()}
    minimum = analytic_minimum(built["cfg"], built["mesh"])
    total = sum(s["bytes"] for s in stats.values())
    floor = sum(minimum.values())
    ratio = None if floor == 0 else total / floor
    return {
        "layout": layout, "config": config,
        "collectives": {kind: s for kind, s in stats.items() if s["count"]},
        "bytes_per_device": total, "analytic_min_bytes": round(floor), "analytic_by_axis": {
            a: round(v) for a, v in minimum.items() if v},
        "ratio": None if ratio is None else round(ratio, 2),
        "flag": bool(ratio is not None and ratio > 1.10) or (floor == 0 and total > 0),
        # collective sites run asynchronously around other work (GPU schedules; none on CPU)
        "overlapped_sites": {k: f"{v['overlapped']}/{v['sites']}" for k, v in async_overlap(text).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--layouts", default="1,dp8,dp2-tp4,dp8-zero1,dp8-zero3,dp2-cp2-tp2,dp2-pp2-tp2")
    ap.add_argument("overrides", nargs="*", default=["train.grad_accum=2"],
                    help="config overrides (default train.grad_accum=2, so that dp=8 divides the batch of 16)")
    ap.add_argument("--mock-gpus", type=int, default=0,
                    help="compile for this many mocked one-GPU hosts on a machine with one GPU (mock NCCL)")
    ap.add_argument("--dump", help="folder to write each layout's compiled HLO text to")
    ap.add_argument("--from-hlo", help="read each layout's HLO from this folder (a --dump) instead of compiling")
    args = ap.parse_args()
    if args.mock_gpus:  # before JAX starts its backend
        import jax
        os.environ["JAX_PLATFORMS"] = "cuda"
        # slices x hosts x GPUs per host; the local host must have as many GPUs as the machine
        jax.config.update("jax_mock_gpu_topology", f"1x{args.mock_gpus}x1")
    results = []
    for layout in args.layouts.split(","):
        try:
            result = measure(args.config, layout, args.overrides, args.dump, args.from_hlo)
        except Exception as e:  # one broken layout should not hide the others' figures
            result = {"layout": layout, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(json.dumps(result), flush=True)
        results.append(result)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
