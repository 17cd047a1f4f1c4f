"""How right is `pjax.plan`? Its predicted step time against the measured one, layout by layout.

    python benchmarks/plan_accuracy.py        # picotron-cpu and a wider variant, 22 layouts each; mixtral-tiny, 5
    python benchmarks/plan_accuracy.py --configs picotron-cpu --layouts dp8-m2,dp2-tp4-m2 --plot acc.png
    python benchmarks/plan_accuracy.py --measured earlier.jsonl --calibration cal.json   # predictions only
    python benchmarks/plan_accuracy.py --measured a.jsonl,b.jsonl,c.jsonl --calibration cal.json   # and agreement

For every layout (planner names, e.g. `dp2-pp2-tp2-m2`) on 8 forced CPU devices:
- the planner's two predictions: the analytic one it ranks all layouts with before compiling,
  and the one from the compiled step's collectives and memory (what its table prints), with
  the `cpu` device profile;
- the measured step: `benchmarks/step.py` in its own process (median of `--steps` after a warm-up), in
  `--repeats` passes over all the layouts: the passes' median is compared, their range reported.
With `--calibration`, the calibrated prediction also charges each config's pipelines what that config's own
pipeline pays here, and its tp layouts the residual stream's work they repeat (`pjax.plan.pipeline_cost`,
`pjax.plan.stream_cost`: measured once per config unless the record holds that config's, as `python -m pjax.plan
--calibrate` does).
Then per config: Spearman's rank correlation and the median relative error of each prediction. With several
`--measured` runs (the first fills the rows), also how well the runs rank alike (Spearman between each pair
of them: what this host's noise leaves of a ranking) and each prediction's Spearman against each run.
Per-device memory is compared only where the backend reports it (`memory_stats()`: GPUs);
XLA:CPU keeps no allocator statistics, so on CPU the memory column is the compiled figure alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# name: (the shipped config, its overrides, its layouts)
DENSE = ("1-m4,dp8-m2,dp8-zero1-m2,dp8-zero3-m2,dp4-tp2-m2,dp2-tp4-m2,dp2-tp4-zero1-m2,dp4-cp2-m2,"
         "dp2-cp2-tp2-m2,dp2-pp2-tp2-m2,dp4-pp2-m4,dp4-tp2-remat-m2,"
         "dp4-tp2-zero3-m2,dp2-tp4-sp-m2,dp4-tp2-sp-m2,dp4-cp2-all_gather-m2,dp2-cp2-tp2-ulysses-m2,"
         "dp4-pp2-afab-m4,dp4-pp2-zb_h1-m4,dp2-pp2-tp2-interleaved2-m4,dp2-pp2-cp2-m2,dp8-remat-m2")
CONFIGS = {
    "picotron-cpu": ("picotron-cpu", [], DENSE),
    # 3.6x picotron-cpu's FLOPs per token: wider matmuls, the same 4 layers and batch
    "picotron-cpu-wide": ("picotron-cpu", ["model.hidden_size=512", "model.intermediate_size=1376",
                                           "model.num_attention_heads=8", "model.num_key_value_heads=4"], DENSE),
    "mixtral-tiny": ("mixtral-tiny", [], "1-m2,dp8-m2,dp4-tp2-m2,dp2-tp2-m2,dp4-m2"),
}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation, tied values sharing their average rank (on a shared host the planner
    prices pipelines of one micro-batch count alike, whatever their schedule)."""
    def rank(x: list[float]) -> np.ndarray:
        values = np.asarray(x, dtype=float)
        order = np.argsort(np.argsort(values)).astype(float)
        return np.array([order[values == v].mean() for v in values])
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def measure(config: str, overrides: list[str], layout, steps: int) -> dict:
    """benchmarks/step.py for this layout of the shipped `config`, in a process of its own."""
    from pjax.malloc import huge_pages_env

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.update(huge_pages_env(env))
    bench = f"dp{layout.dp}-pp{layout.pp}-cp{layout.cp}-tp{layout.tp}"
    cmd = [sys.executable, os.path.join(HERE, "step.py"), "--one", bench, "--config", config,
           "--steps", str(steps), "--warmup", "1", *overrides, *layout.overrides()]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predictions(name: str, config, layout, profile, calibrated) -> dict:
    """One layout's row: the analytic, compiled and (with a calibration) calibrated predictions."""
    from pjax.observe.hlo_flops import StepMatmuls
    from pjax.plan.compile import Compiler
    from pjax.plan.estimate import predict
    from pjax.plan.layouts import check
    from pjax.plan.search import score

    check(config, layout)
    devices = layout.dp * layout.pp * layout.cp * layout.tp
    analytic = score(config, layout, profile, devices, 1.0)
    compiled = Compiler(profile, devices, devices, None, workers=0).run(config, [layout])[layout]
    memory = compiled["memory"]["total"]
    matmuls = StepMatmuls.from_json(compiled.get("matmuls"))
    planned = predict(config, layout, profile, compiled["comm"], memory, 1.0, matmuls)
    row = {"config": name, "layout": layout.name, "devices": devices, "analytic_ms": round(analytic.step_s * 1e3, 1),
           "predicted_ms": round(planned.step_s * 1e3, 1), "limit": planned.limit,
           "compiled_memory_mb": round(memory / 2**20, 1), "measured_memory_mb": None, "error": None}
    if calibrated is not None:
        row["calibrated_ms"] = round(predict(config, layout, calibrated, compiled["comm"], memory, 1.0,
                                             matmuls).step_s * 1e3, 1)
    return row


def with_steps(profile, record: dict, name: str, shipped: str, overrides: list[str]):
    """`profile` with the calibration's curves and its sections that time this config's own steps: what a
    pipeline pays and what tp repeats (`pipeline_cost`, `stream_cost`). The record's own measurement where it was
    of this config and of the pair of steps timed today (each module's `pair`), else measured now, as `python -m
    pjax.plan --calibrate` does for the config it plans (printed as a line of its own)."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.plan import pipeline_cost, stream_cost
    from pjax.plan.curves import Curves

    config = load_config(shipped, overrides)
    sections = {}
    for section, names, today, measure in (
            ("pipeline", ("flat", "pipeline"), pipeline_cost.pair(record["devices"]), pipeline_cost.measure_pipeline),
            ("stream", ("plain", "split"), stream_cost.pair(record["devices"], config.model.num_key_value_heads),
             stream_cost.measure_stream)):
        measured = record.get(section) or {}
        if (measured.get("config"), measured.get("overrides"), [measured.get(n) for n in names]) != (
                shipped, overrides, [layout.name for layout in today]):
            measured = measure(shipped, overrides)
            print(json.dumps({"config": name, section: measured}), flush=True)
        sections[section] = measured
    return dataclasses.replace(profile, curves=Curves({**record, **sections}))


def summarise(rows: list[dict]) -> dict:
    """Spearman and median relative error of each prediction against the measured medians."""
    ok = [r for r in rows if r["measured_ms"]]
    meas = [r["measured_ms"] for r in ok]
    stats = {"layouts": len(ok)}
    for key in ("analytic_ms", "predicted_ms", *(["calibrated_ms"] if ok and "calibrated_ms" in ok[0] else [])):
        pred = [r[key] for r in ok]
        stats[key] = {"spearman": round(spearman(pred, meas), 3),
                      "median_rel_error": round(float(np.median([abs(p - m) / m for p, m in zip(pred, meas)])), 3)}
    return stats


def agreement(name: str, rows: list[dict], runs: dict[str, dict]) -> dict:
    """Spearman between every two measured runs of config `name` (over the layouts both measured), and of each
    prediction against each run: where two runs of the same layouts rank them alike at rho, a prediction checked
    against either cannot be told apart from one that ranks better than rho."""
    measured = {run: {layout: r["measured_ms"] for (config, layout), r in seen.items()
                      if config == name and r.get("measured_ms")} for run, seen in runs.items()}

    def rho(a: dict[str, float], b: dict[str, float]) -> float:
        common = sorted(set(a) & set(b))
        return round(spearman([a[k] for k in common], [b[k] for k in common]), 3)

    names = [run for run in measured if measured[run]]
    out = {"between_runs": {f"{a} ~ {b}": rho(measured[a], measured[b])
                            for i, a in enumerate(names) for b in names[i + 1:]}}
    for key in ("analytic_ms", "predicted_ms", "calibrated_ms"):
        predicted = {r["layout"]: r[key] for r in rows if r.get(key)}
        if predicted:
            out[key] = {run: rho(predicted, measured[run]) for run in names}
    return out


def measure_all(shipped: str, overrides: list[str], layouts: list, rows: list[dict], steps: int,
                repeats: int) -> None:
    """Each layout's measured median and range into its row, over `repeats` whole passes (so that the
    machine's drift over the run shows in each layout's spread)."""
    times: list[list[float]] = [[] for _ in layouts]
    for _ in range(repeats):
        for layout, row, seen in zip(layouts, rows, times):
            measured = measure(shipped, overrides, layout, steps)
            row["error"] = measured.get("error") or row.get("error")
            if measured.get("step_ms"):
                seen.append(measured["step_ms"])
    for row, seen in zip(rows, times):
        row["measured_ms"] = round(float(np.median(seen)), 1) if seen else None
        row["measured_range_ms"] = [min(seen), max(seen)] if seen else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--layouts", default=None, help="comma-separated planner names (default: each config's own)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measurement passes over all layouts: the median is compared, the range reported")
    ap.add_argument("--plot", default=None, help="predicted against measured step time, to this PNG")
    ap.add_argument("--calibration", default=None,
                    help="a `python -m pjax.plan.calibrate` record of this machine: adds the calibrated predictions")
    ap.add_argument("--measured", default=None,
                    help="earlier runs' output, comma-separated: take the first's measured times instead of "
                         "measuring again, and compare the runs' rankings")
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from pjax.config_io import load_config
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    profile = PROFILES["cpu"]
    record = None
    if args.calibration:
        with open(args.calibration) as f:
            record = json.load(f)
    runs = {}  # earlier runs' printed rows: their measured times, with this checkout's predictions
    for path in args.measured.split(",") if args.measured else ():
        with open(path) as f:
            runs[os.path.basename(path)] = {(r["config"], r["layout"]): r for r in map(json.loads, f) if "layout" in r}
    earlier = next(iter(runs.values()), None)
    summary = {}
    for name in args.configs.split(","):
        shipped, overrides, layouts = CONFIGS[name]
        config = load_config(shipped, overrides)
        parsed = list(map(Layout.parse, (args.layouts or layouts).split(",")))
        calibrated = None if record is None else with_steps(profile, record, name, shipped, overrides)
        rows = [predictions(name, config, layout, profile, calibrated) for layout in parsed]
        if earlier is None:
            measure_all(shipped, overrides, parsed, rows, args.steps, args.repeats)
        for row in rows:
            if earlier is not None:
                seen = earlier.get((name, row["layout"]), {})
                row.update(measured_ms=seen.get("measured_ms"), measured_range_ms=seen.get("measured_range_ms"))
            print(json.dumps(row), flush=True)
        summary[name] = {**summarise(rows), "rows": rows}
        print(json.dumps({"config": name, **summarise(rows)}), flush=True)
        if len(runs) > 1:
            print(json.dumps({"config": name, "agreement": agreement(name, rows, runs)}), flush=True)
    if args.plot:
        plot(summary, args.plot)


def plot(summary: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for name, s in summary.items():
        ok = [r for r in s["rows"] if r["measured_ms"]]
        dots = ax.scatter([r["measured_ms"] for r in ok], [r["predicted_ms"] for r in ok], label=name)
        for r in ok:
            ax.annotate(r["layout"], (r["measured_ms"], r["predicted_ms"]), fontsize=6)
        calibrated = [r for r in ok if r.get("calibrated_ms")]
        if calibrated:
            ax.scatter([r["measured_ms"] for r in calibrated], [r["calibrated_ms"] for r in calibrated], marker="x",
                       color=dots.get_facecolor()[0], label=f"{name}, calibrated")
    lo, hi = ax.get_xlim()
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("pjax.plan on 8 CPU devices")
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
