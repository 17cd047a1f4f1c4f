"""The kernels a step runs on GPUs, read from XLA:GPU's compile for compile-only GPUs (no GPU needed).

    python benchmarks/gpu_kernels.py --config debug --layouts dp8,dp8-zero1,dp2-tp4-sp
    python benchmarks/gpu_kernels.py --config smollm-360m --layouts 1 precision.preset=fp8 train.batch_size=16
    python benchmarks/gpu_kernels.py --layouts dp8-zero1 --attention chunked   # the program before cuDNN's
    python benchmarks/gpu_kernels.py --layouts dp8-zero1 --no-xla-options       # XLA's defaults

One JSON line per layout (the planner's layout names, `pjax.plan.layouts.Layout`): the attention kernel
(`chunked` where `pjax.cudnn_fallback` had to step in), cuDNN's fused attention calls per step, GEMMs per step
by operand dtype with their FLOPs (`hlo_flops.gemm_census`), collectives per step by kind
(`hlo.collective_stats`) and by mesh axes with their bytes per device (`hlo.collectives_by_axis`), how many of
their places have compute scheduled inside (`hlo.async_overlap`), and the compile's seconds. A pipeline's tick
parts count as often as its table runs them on an average device. Each layout is compiled the way the planner
and `pjax.train` compile it (`pjax.plan.compile.compile_planned`); no autotuning happens on compile-only GPUs,
so this is what runs, not how fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin still makes compile-only GPUs


def kernels_compiled(config: str, layout_name: str, overrides: list[str], kind: str, per_host: int,
                     attention: str) -> tuple:
    """(config as compiled, trainer, optimized HLO text, compile seconds) of a layout compiled for compile-only
    GPUs of `kind`."""
    from pjax.config_io import load_config
    from pjax.plan import gpu_target
    from pjax.plan.compile import compile_planned
    from pjax.plan.layouts import Layout, with_config_shard
    from pjax.plan.profiles import PROFILES

    profile = gpu_target.planned_profile(PROFILES[kind], "gpu")  # cuDNN's attention where it compiles here
    profile = profile if attention == "cudnn" else dataclasses.replace(profile, attention=attention)
    start = time.perf_counter()
    cfg = load_config(config, overrides)
    layout = with_config_shard(Layout.parse(layout_name), cfg)  # an override's HSDP group where the name gives none
    compiled_cfg, trainer, compiled = compile_planned(cfg, layout, profile, per_host, "gpu")
    return compiled_cfg, trainer, compiled.as_text(), round(time.perf_counter() - start, 1)


def kernels(config: str, layout_name: str, overrides: list[str], kind: str, per_host: int, attention: str
            ) -> dict:
    from pjax.observe.hlo import async_overlap, collective_stats
    from pjax.observe.hlo_flops import fused_attention, gemm_census
    from pjax.parallel.pipeline.table import tick_runs
    from pjax.plan.inspect import step_collectives, step_part_runs
    from pjax.plan.layouts import Layout

    cfg, trainer, hlo, seconds = kernels_compiled(config, layout_name, overrides, kind, per_host, attention)
    # A pipeline's tick parts counted as often as its table runs them on an average device, not once per tick.
    parts, mesh_shape = step_part_runs(cfg), dict(trainer.mesh.shape)
    scale = tick_runs(cfg.pipeline, cfg.mesh.pp, cfg.train.grad_accum, cfg.mesh.cp > 1) if parts else (lambda k, l: 1)
    return {"config": config, "layout": Layout.parse(layout_name).name, "devices": trainer.mesh.devices.size,
            "kind": kind, "attention": trainer.tc.attention, "fused_attention": fused_attention(hlo, parts),
            "gemms": gemm_census(hlo, parts),
            "collectives": {k: v["count"] for k, v in collective_stats(hlo, scale=scale).items() if v["count"]},
            "by_axes": {axes: {"count": row["count"], "bytes": row["bytes"]}
                        for axes, row in step_collectives(cfg, mesh_shape, hlo, per_host).items()},
            "overlap": async_overlap(hlo), "xla_options": bool(trainer.xla_options), "compile_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="debug")
    ap.add_argument("--layouts", default="dp8,dp8-zero1,dp8-zero3,dp2-tp4,dp2-tp4-sp")
    ap.add_argument("--kind", default="h100", choices=("h100", "h200", "a100"))
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--attention", default="cudnn", help="train.attention: cudnn, or chunked (the fallback's)")
    ap.add_argument("--no-xla-options", action="store_true", help="XLA's defaults (train.xla_options=false)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    overrides = args.overrides + (["train.xla_options=false"] if args.no_xla_options else [])
    for name in args.layouts.split(","):
        print(json.dumps(kernels(args.config, name, overrides, args.kind, args.devices_per_host, args.attention)),
              flush=True)


if __name__ == "__main__":
    main()
