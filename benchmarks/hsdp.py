"""HSDP (`train.zero_shard`) against flat ZeRO: the bytes a step sends across hosts, and its time on CPU devices.

    python benchmarks/hsdp.py --gpu                      # llama2-7b on 64 compile-only H100s, 8 per host
    python benchmarks/hsdp.py --cpu                      # debug on 8 CPU devices: step time, flat and HSDP
    python benchmarks/hsdp.py --rank --config llama3-8b --layout dp32-tp2-zero3-m8 --shards 0,4   # the planner's view

One JSON line per layout. `--gpu` compiles the step for compile-only GPUs (`gpu_kernels.kernels`, the planner's
compile) and sums, per device and step, the bytes of the collectives whose groups span hosts (`inter_bytes`) and
their ring link bytes (`inter_link_bytes`), beside those inside a host. `--cpu` times `--steps` steps after one
warm-up (median seconds): the point is that nothing is lost, the CPU has no network between its "hosts".
`--rank` gives the planner's prediction of each (`python -m pjax.plan --explain`'s figures: the step, its dp term,
the dp collectives' link bytes inside and across hosts) on compile-only H100s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin still makes compile-only GPUs
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def across_hosts(config: str, layout: str, shard: int, per_host: int) -> dict:
    """The compiled step's collective bytes per device and step, inside and across hosts."""
    from gpu_kernels import kernels_compiled
    from pjax.observe.hlo import collectives_by_axis

    overrides = [f"train.zero_shard={shard}"] if shard else []
    _, trainer, hlo, seconds = kernels_compiled(config, layout, overrides, "h100", per_host, "cudnn")
    rows = collectives_by_axis(hlo, dict(trainer.mesh.shape), per_host, merge=False)
    inter = [row for row in rows.values() if row["inter_host"]]
    intra = [row for row in rows.values() if not row["inter_host"]]
    return {"config": config, "layout": layout, "zero_shard": shard, "devices": trainer.mesh.devices.size,
            "per_host": per_host, "inter_bytes": sum(r["bytes"] for r in inter),
            "inter_link_bytes": round(sum(r["link_bytes"] for r in inter)),
            "intra_bytes": sum(r["bytes"] for r in intra),
            "by_axes": {axes: {"bytes": row["bytes"], "kinds": row["kinds"], "inter_host": row["inter_host"]}
                        for axes, row in rows.items() if row["count"]},
            "compile_s": seconds}


def planned(config: str, layout: str, shard: int, per_host: int) -> dict:
    """The planner's prediction for `layout` with ZeRO's groups of `shard`, compiled for compile-only H100s."""
    import dataclasses

    from pjax.config_io import load_config
    from pjax.observe.hlo_flops import StepMatmuls
    from pjax.plan.compile import compile_layout
    from pjax.plan.estimate import across_link_bytes, predict
    from pjax.plan.layouts import Layout, planned_config
    from pjax.plan.profiles import PROFILES

    cfg, h100 = load_config(config), PROFILES["h100"]
    chosen = dataclasses.replace(Layout.parse(layout), zero_shard=shard)
    result = compile_layout(cfg, chosen, h100, per_host, "gpu")
    p = predict(planned_config(cfg, chosen, h100), chosen, h100, result["comm"], result["memory"]["total"], 0.75,
                StepMatmuls.from_json(result["matmuls"]))
    crossing = sum(across_link_bytes(row) for row in result["comm"].values())
    inside = sum(row["link_bytes"] for row in result["comm"].values()) - crossing
    return {"config": config, "layout": chosen.name, "step_ms": round(p.step_s * 1e3, 1),
            "terms_ms": {k: round(v * 1e3, 1) for k, v in p.terms.items() if v}, "limit": p.limit, "fits": p.fits,
            "memory_gib": round(p.memory_bytes / 2**30, 1), "link_bytes_inside": round(inside),
            "link_bytes_across": round(crossing)}


def step_time(shard: int, steps: int) -> dict:
    """debug at dp 8, ZeRO-3: the median step of `steps` after a warm-up."""
    import jax

    from common import random_batch, trainer_for

    overrides = ["mesh.dp=8", "mesh.tp=1", "train.zero=3", f"train.zero_shard={shard}", "train.batch_size=16"]
    _, trainer = trainer_for("debug", overrides)
    state = trainer.init(jax.random.key(0))
    batch = random_batch(trainer)
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return {"config": "debug", "layout": "dp8-zero3", "zero_shard": shard, "steps": steps,
            "median_s": round(statistics.median(times), 4), "loss": round(float(metrics["loss"]), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="bytes across hosts on compile-only H100s")
    ap.add_argument("--cpu", action="store_true", help="step time on 8 CPU devices")
    ap.add_argument("--rank", action="store_true", help="the planner's prediction on compile-only H100s")
    ap.add_argument("--config", default="llama2-7b")
    ap.add_argument("--layout", default="dp64-zero3-remat-m4")
    ap.add_argument("--shards", default="0,8", help="train.zero_shard values (0: flat ZeRO)")
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.cpu:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        for shard in (0, 4, 2):
            print(json.dumps(step_time(shard, args.steps)), flush=True)
    for shard in map(int, args.shards.split(",")) if args.gpu or args.rank else ():
        if args.gpu:
            print(json.dumps(across_hosts(args.config, args.layout, shard, args.devices_per_host)), flush=True)
        if args.rank:
            print(json.dumps(planned(args.config, args.layout, shard, args.devices_per_host)), flush=True)


if __name__ == "__main__":
    main()
