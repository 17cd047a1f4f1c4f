"""What each of pjax's XLA:GPU options changes in a compiled step, read from compile-only GPUs (no GPU needed).

    python benchmarks/xla_options.py --config smollm-1.7b --layout 1 train.batch_size=16 train.grad_accum=4
    python benchmarks/xla_options.py --config smollm-1.7b --layout dp8-zero1 train.batch_size=64 train.grad_accum=4

One JSON line per compile of `--layout` (the planner's names): pjax's options all set (`pjax`), XLA's defaults
(`train.xla_options=false`), and each option (`pjax.xla_options.GPU_OPTIONS`) left out in turn (`-<option>`, XLA's
default in its place). Each line: the optimized HLO's size and fusion count, the compile's seconds, per-device
memory, collectives per step by kind and how many of their places have compute scheduled inside them
(`hlo.async_overlap`), cuBLAS and Triton GEMM calls, and whether the program equals pjax's (its text with
names stripped). No autotuning happens on compile-only GPUs: this is what runs, not how fast.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin still makes compile-only GPUs


def _shape(hlo: str) -> str:
    """A digest of the program with instruction names, metadata and the trailing table of Python stack frames
    (which names the caller's lines) stripped: equal programs, equal digests."""
    text = "\n".join(line for line in hlo.splitlines() if line.startswith(("%", "ENTRY", "  ", "}")))
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%", text)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def compiled_step(config: str, layout: str, overrides: list[str], kind: str, per_host: int) -> dict:
    """One compile's figures (see the module's docstring)."""
    from pjax.config_io import load_config
    from pjax.observe.hlo import async_overlap, collective_stats
    from pjax.observe.memory import step_memory_bytes
    from pjax.plan import gpu_target
    from pjax.plan.compile import compile_planned
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import PROFILES

    start = time.perf_counter()
    profile = gpu_target.planned_profile(PROFILES[kind], "gpu")
    _, trainer, compiled = compile_planned(load_config(config, overrides), Layout.parse(layout), profile, per_host,
                                           "gpu")
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    return {"hlo_mb": round(len(hlo) / 1e6, 2), "fusions": len(re.findall(r" fusion\(", hlo)),
            "compile_s": round(seconds, 1), "memory_gib": round(step_memory_bytes(compiled) / 2 ** 30, 2),
            "collectives": {k: v["count"] for k, v in collective_stats(hlo).items() if v["count"]},
            "overlap": {k: f"{v['overlapped']}/{v['sites']}" for k, v in async_overlap(hlo).items() if v["sites"]},
            "cublas_gemms": hlo.count('custom_call_target="__cublas$'),
            "triton_gemms": len(re.findall(r'"kind":"__triton_(?:nested_)?gemm', hlo)),
            "options": sorted(trainer.xla_options or {}), "program": _shape(hlo)}


def main() -> None:
    from pjax import xla_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm-1.7b")
    ap.add_argument("--layout", default="1")
    ap.add_argument("--kind", default="h100", choices=("h100", "h200", "a100"))
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated options to leave out (default: each in turn)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    args = ap.parse_args()
    run = lambda extra=(): compiled_step(args.config, args.layout, args.overrides + list(extra),  # noqa: E731
                                         args.kind, args.devices_per_host)
    base = run()
    print(json.dumps({"compile": "pjax", "layout": args.layout, **base}), flush=True)
    defaults = run(["train.xla_options=false"])
    print(json.dumps({"compile": "xla defaults", "same_as_pjax": defaults["program"] == base["program"], **defaults}),
          flush=True)
    every = dict(xla_options.GPU_OPTIONS)
    for option in (args.only.split(",") if args.only else every):
        xla_options.GPU_OPTIONS.pop(option)
        try:
            result = run()
        finally:
            xla_options.GPU_OPTIONS.clear()
            xla_options.GPU_OPTIONS.update(every)
        print(json.dumps({"compile": f"-{option}", "same_as_pjax": result["program"] == base["program"], **result}),
              flush=True)


if __name__ == "__main__":
    main()
