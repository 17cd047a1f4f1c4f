"""Training-step benchmark per parallel layout: compile time, step time, tokens/s, MFU, memory.

    python benchmarks/step.py                                  # picotron-cpu shape, Picotron's layouts
                                                               # (against Picotron itself: vs_picotron.py)
    python benchmarks/step.py --layouts dp8,dp2-tp4,dp8-zero3 --steps 10
    python benchmarks/step.py --config smollm-135m --layouts dp8 --aot   # compile only: memory, no timing

Each layout runs in its own process with exactly as many (forced CPU) devices as its mesh, so
layouts do not share one device pool; its whole stderr is passed on. Output: one JSON object per layout on
stdout (a JSON array at the end): compile and step time, memory, cuDNN attention calls and each GEMM operand
kind's share of the FLOPs read from the compiled step, pjax's XLA options and XLA_FLAGS; `--plot PNG` for a
bar chart.
Layout names: `1` (one device) or `-`-joined parts such as `dp2-tp2`, `dp8-zero3`, `pp2`, `cp2`,
`pp2-remat` (remat='full' under the layer scan).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from common import compile_step, random_batch, use_layout_devices
from mesh.mesh import data_size
from pjax.malloc import huge_pages_env


def run_one(config: str, layout: str, steps: int, warmup: int, aot: bool, overrides: list[str],
            hlo_count: str | None = None) -> dict:
    """Build the trainer for one layout in this process and measure it; `hlo_count`: a string whose
    occurrences in the compiled step's HLO are counted (e.g. an fp8 GEMM's custom-call target)."""
    use_layout_devices(layout)
    import jax
    import numpy as np

    from pjax.observe.metrics import model_flops_per_token, peak_flops
    from pjax.observe.hlo_flops import dot_products
    from pjax.observe.memory import step_memory_bytes

    built = compile_step(config, layout, overrides)
    cfg, mesh, trainer, compiled = built["cfg"], built["mesh"], built["trainer"], built["compiled"]
    mc, tc = cfg.model, cfg.train
    n_dev = mesh.devices.size
    param_bytes = 4 * mc.num_params
    # Analytic per-device state: params + grads + 2 Adam moments (fp32), each split as the layout splits them.
    p_split = mesh.shape["tp"] * mesh.shape["pp"] * (data_size(mesh) if tc.zero >= 3 else 1)
    m_split = mesh.shape["tp"] * mesh.shape["pp"] * (mesh.shape["dp"] if tc.zero >= 1 else 1)
    analytic = param_bytes / p_split * 2 + 2 * param_bytes / m_split
    result = {
        "layout": layout, "config": config, "device": jax.devices()[0].device_kind, "devices": n_dev, "compile_s": round(built["compile_s"], 2),
        "device_memory_mb": round(step_memory_bytes(compiled) / 2**20, 2),
        "temp_memory_mb": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
        "analytic_state_mb": round(analytic / 2**20, 2),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES") or None,
    }
    hlo = compiled.as_text()
    if hlo_count:
        result["hlo_count"] = {hlo_count: hlo.count(hlo_count)}
    result.update(kernels(hlo), xla_options=trainer.xla_options or {}, xla_flags=os.environ.get("XLA_FLAGS") or None)
    # each matmul shape the compiled step runs, and how often: the planner's calibrated compute replays them
    result["dot_products"] = [[*shape, runs] for shape, runs in dot_products(hlo).items()]
    if aot:
        return result
    batch = random_batch(trainer)
    state = trainer.init(jax.random.key(0))
    for _ in range(warmup):
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    tps = tc.batch_size * tc.seq_len / step_s
    flops = tps * model_flops_per_token(mc, tc.seq_len)
    peak = peak_flops(jax.devices()[0], cfg.log.peak_flops)
    result.update(step_ms=round(1000 * step_s, 1), tokens_per_sec=round(tps), model_tflops=round(flops / 1e12, 4),
                  mfu=None if not peak else round(flops / n_dev / peak, 4))
    stats = jax.devices()[0].memory_stats() or {}  # the allocator's figures (GPUs); XLA:CPU keeps none
    if "peak_bytes_in_use" in stats:
        result["peak_memory_mb"] = round(stats["peak_bytes_in_use"] / 2**20, 1)
    return result


def kernels(hlo_text: str) -> dict:
    """What the compiled step runs, read from its program with each loop's trip count (`pjax.observe.hlo.walk`):
    cuDNN's fused attention calls per step, and each GEMM operand kind's share of the GEMM FLOPs."""
    from pjax.observe.hlo_flops import fused_attention, gemm_census

    census = gemm_census(hlo_text)
    total = sum(row["flops"] for row in census.values()) or 1.0
    return {"cudnn_attention": fused_attention(hlo_text),
            "gemm_flop_share": {kind: round(row["flops"] / total, 4) for kind, row in census.items()}}


def run_layout(config: str, layout: str, steps: int, warmup: int, aot: bool, overrides: list[str],
               hlo_count: str | None = None) -> dict:
    """`run_one` for one layout in a process of its own, with that layout's devices and XLA:CPU's
    buffers on huge pages as `pjax.train` runs them (pjax/malloc.py): its result, or
    {'layout', 'error'} with the process's last line of stderr (all of which goes on to this one's)."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    # The layout forces its own CPU device count; a user's other XLA flags stay, and the result records them.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.pop("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    env.update(huge_pages_env(env))
    cmd = [sys.executable, __file__, "--one", layout, "--config", config, "--steps", str(steps),
           "--warmup", str(warmup), *(["--aot"] if aot else []), *(["--hlo-count", hlo_count] if hlo_count else []),
           *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode:
        return {"layout": layout, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--layouts", default="1,dp2,tp2,pp2,pp2-remat,cp2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--aot", action="store_true", help="compile only (memory and compile time, no timing)")
    ap.add_argument("--hlo-count", default=None, help="count this string in the compiled step's HLO")
    ap.add_argument("--plot", default=None, help="write a bar chart of tokens/s to this PNG")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every layout")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.config, args.one, args.steps, args.warmup, args.aot, args.overrides,
                                 args.hlo_count)))
        return
    results = []
    for layout in args.layouts.split(","):
        result = run_layout(args.config, layout, args.steps, args.warmup, args.aot, args.overrides, args.hlo_count)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


def plot(results: list[dict], out: str) -> None:
    """Bars of pjax's tokens/s per layout, with Picotron's beside them where a result carries
    `picotron_tokens_per_sec` (as benchmarks/vs_picotron.py's do)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in results if "tokens_per_sec" in r]
    fig = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = range(len(ok))
    ax.bar([x - 0.2 for x in xs], [r["tokens_per_sec"] for r in ok], width=0.4, label="pjax")
    pico = [r.get("picotron_tokens_per_sec") or 0 for r in ok]
    if any(pico):
        ax.bar([x + 0.2 for x in xs], pico, width=0.4, label="Picotron")
    ax.set_xticks(list(xs), [r["layout"] for r in ok])
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
