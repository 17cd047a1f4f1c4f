"""Mixture of Experts: all-to-all traffic against the analytic volume, dropped tokens against the
capacity factor, and step time of dropless against capacity routing.

    python benchmarks/moe.py                                  # mixtral-tiny, the default layouts
    python benchmarks/moe.py --layouts dp4-tp2 --steps 20 --plot benchmarks/plots   (from the repository root)

Three measurements, each a JSON line:
  traffic   per layout and routing, AOT from shapes: all-to-all count and bytes per device per step
            read from the compiled HLO (`pjax/observe/hlo.py`), next to the analytic volume: each routed
            (token, expert) pair's hidden vector sent to its expert and back, forward and backward,
            per MoE layer and micro-batch (4 * tokens per device * k * D * 4 bytes; a pipeline stage
            holds L/pp of the layers). The buffer an
            all-to-all moves is [E, C, D] whatever the routing did, so the ratio is E*C / (n*k):
            about the capacity factor for capacity routing, E/k for dropless (C = n, no drops).
  drops     the fraction of assignments dropped at each capacity factor, at initialisation on a
            batch of the shipped text (the router is untrained, so its load is uneven).
  time      median step time of each routing over --steps steps on each --time_layouts layout
            (random tokens); `dense` under expert parallelism is the padded [E, n, D] exchange that
            dropless ran before it went ragged.
  gpu       (--gpu) compiled for 8 compile-only H100s at dp 8, for the uncapped receive buffer and each
            --receive_factors cap, with tokamax's grouped kernels and (--kernel xla, one process each:
            the choice is cached) XLA's own ragged_dot: ragged all-to-alls and grouped kernels per step,
            the GEMM FLOPs XLA computes for the experts against the routed rows' FLOPs, temporaries.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from common import parse_layout, random_batch  # noqa: E402


def build(config: str, layout: str, routing: str, factor: float, overrides: list[str]):
    import jax

    from mesh.mesh import make_mesh
    from models.moe import MoeConfig
    from pjax.config_io import load_config
    from pjax.step import build_trainer

    sizes, extra = parse_layout(layout)
    cfg = load_config(config, [f"mesh.{k}={v}" for k, v in sizes.items()] + extra + list(overrides))
    n = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
    mesh = make_mesh(cfg.mesh, jax.devices()[:n], cfg.model.num_local_experts)
    return cfg, build_trainer(mesh, cfg.model, cfg.train, cfg.pipeline, MoeConfig(routing, factor, cfg.moe.receive_factor))


def analytic_bytes(cfg, dp: int, pp: int = 1) -> int:
    """Each routed token's hidden vector to its expert and back, forward and backward (fp32), for
    the MoE layers of one device (a pipeline stage holds L/pp of them)."""
    mc, tc = cfg.model, cfg.train
    tokens = tc.batch_size // tc.grad_accum // dp * tc.seq_len  # per device per micro-batch
    return 4 * tc.grad_accum * mc.num_hidden_layers // pp * tokens * mc.num_experts_per_tok * mc.hidden_size * 4


def traffic(config: str, layout: str, routing: str, factor: float, overrides: list[str]) -> dict:
    from pjax.observe.hlo import collective_stats

    cfg, trainer = build(config, layout, routing, factor, overrides)
    t0 = time.perf_counter()
    compiled = trainer.compile_step()
    stats = collective_stats(compiled.as_text())["all-to-all"]
    floor = analytic_bytes(cfg, trainer.mesh.shape["dp"], trainer.mesh.shape["pp"])
    return {"kind": "traffic", "layout": layout, "routing": routing, "capacity_factor": factor,
            "all_to_all_count": stats["count"], "all_to_all_bytes": stats["bytes"], "analytic_bytes": floor,
            "ratio": round(stats["bytes"] / floor, 2), "compile_s": round(time.perf_counter() - t0, 1)}


def drops(config: str, layout: str, factor: float, overrides: list[str]) -> dict:
    import jax

    from pjax.data import build_data

    cfg, trainer = build(config, layout, "capacity", factor, overrides)
    data, _, _ = build_data(cfg.data, cfg.train, trainer.mesh)
    _, metrics = trainer.step(trainer.init(jax.random.key(cfg.train.seed)), next(data))
    return {"kind": "drops", "layout": layout, "capacity_factor": factor,
            "dropped_fraction": round(float(metrics["dropped_fraction"]), 4),
            "load_min": round(float(metrics["load_min"]), 3), "load_max": round(float(metrics["load_max"]), 3)}


def step_time(config: str, layout: str, routing: str, factor: float, steps: int, overrides: list[str]) -> dict:
    import jax

    _, trainer = build(config, layout, routing, factor, overrides)
    state, batch = trainer.init(jax.random.key(0)), random_batch(trainer)
    step = trainer.compile_step(state, batch)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return {"kind": "time", "layout": layout, "routing": routing, "capacity_factor": factor,
            "median_step_ms": round(1000 * statistics.median(times[2:]), 1), "steps": steps}


def gpu_flops(config: str, receive_factor: str, kernel: str, overrides: list[str]) -> dict:
    from models import grouped_gemm
    from pjax.config_io import load_config
    from pjax.observe.hlo_flops import scoped_gemm_flops
    from pjax.plan import gpu_target
    from pjax.plan.compile import compile_planned
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    if kernel == "xla":  # XLA:GPU's own ragged_dot, for comparison: as if tokamax were not installed
        grouped_gemm._tokamax = lambda: None
    cap = [] if receive_factor == "null" else [f"moe.receive_factor={receive_factor}"]
    cfg = load_config(config, ["precision.preset=bf16", *cap, *overrides])
    profile = gpu_target.planned_profile(PROFILES["h100"], "gpu")
    cfg, _, step = compile_planned(cfg, Layout.parse("dp8"), profile, 8, "gpu")
    text, mc, tc = step.as_text(), cfg.model, cfg.train
    routed = 9 * mc.num_hidden_layers * tc.batch_size * tc.seq_len // 8 * mc.num_experts_per_tok \
        * 2 * mc.hidden_size * mc.intermediate_size  # 3 GEMMs x (forward + 2 backward) per routed row
    router = scoped_gemm_flops(text, "router")
    experts = scoped_gemm_flops(text, "experts", grouped=False) - router  # XLA's own GEMMs
    bound = scoped_gemm_flops(text, "experts") - router - experts  # the grouped kernels', at their buffers' rows
    return {"kind": "gpu", "config": config, "overrides": overrides, "layout": "dp8", "kernel": kernel,
            "receive_factor": receive_factor, "ragged_all_to_alls": text.count("ragged-all-to-all-start("),
            "grouped_kernels": text.count('custom_call_target="mosaic_gpu'), "xla_expert_gemm_flops": experts,
            "routed_flops": routed, "xla_ratio": round(experts / routed, 3), "kernel_bound_ratio": round(bound / routed, 3),
            "temp_mib": round(step.memory_analysis().temp_size_in_bytes / 2 ** 20, 1)}


def plot(results: list[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.get("kind") == "drops"]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([r["capacity_factor"] for r in rows], [r["dropped_fraction"] for r in rows], "o-")
    ax.set(xlabel="capacity factor", ylabel="assignments dropped", title=f"{rows[0]['layout']}, untrained router")
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "moe_drops.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="mixtral-tiny")
    ap.add_argument("--layouts", default="dp2,dp4,dp8,dp4-tp2,dp2-pp2,dp2-pp2-tp2", help="layouts for the traffic measurement")
    ap.add_argument("--time_layout", default="dp4-tp2", help="the layout whose drops are counted")
    ap.add_argument("--time_layouts", default="dp4-tp2,dp2-pp2-tp2", help="the layouts timed")
    ap.add_argument("--factors", default="0.5,1.0,1.25,1.5,2.0")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--plot", default=None, help="a folder for moe_drops.png")
    ap.add_argument("--gpu", action="store_true", help="only the compile-only H100 measurement")
    ap.add_argument("--receive_factors", default="null,1.0,1.25")
    ap.add_argument("--kernel", default="tokamax", choices=("tokamax", "xla"))
    ap.add_argument("--only_time", action="store_true", help="only the step times")
    ap.add_argument("overrides", nargs="*", default=[])
    args = ap.parse_args()
    jobs = [lambda layout=layout, routing=routing: traffic(args.config, layout, routing, 1.25, args.overrides)
            for layout in args.layouts.split(",") for routing in ("dropless", "capacity")]
    jobs += [lambda f=float(f): drops(args.config, args.time_layout, f, args.overrides) for f in args.factors.split(",")]
    jobs += [lambda layout=layout, routing=routing: step_time(args.config, layout, routing, 1.25, args.steps,
                                                              args.overrides)
             for layout in args.time_layouts.split(",") for routing in ("dropless", "capacity", "dense")]
    if args.only_time:
        jobs = jobs[-3 * len(args.time_layouts.split(",")):]
    if args.gpu:
        jobs = [lambda f=f: gpu_flops(args.config, f, args.kernel, args.overrides)
                for f in args.receive_factors.split(",")]
    results = []
    for job in jobs:
        try:
            result = job()
        except Exception as e:  # one broken measurement should not hide the others
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
