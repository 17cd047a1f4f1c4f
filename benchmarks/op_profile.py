"""Where a training step's time goes: device time per kind of op, read from a `jax.profiler` trace.

    python benchmarks/op_profile.py                                       # picotron-cpu, one CPU device
    python benchmarks/op_profile.py --layout dp2 --top 20
    JAX_PLATFORMS=cuda python benchmarks/op_profile.py --config smollm-360m train.batch_size=32 train.grad_accum=4

Traces `--steps` steady steps and sums the time of every op the devices ran: on a GPU each
kernel on the compute streams, on XLA:CPU each leaf op on the pool threads (the executor's own
bookkeeping left out). Ops are grouped by kind, the HLO name without its number (`ynn_fusion`,
`transpose_copy_fusion`; on GPUs the kernel name: cuDNN's attention, cuBLAS's `nvjet` GEMMs,
XLA's `loop_*`/`input_*` fusions, `memcpy`). Prints one JSON object: step time, busy time per
step, the kinds and the single heaviest ops. This is how this repo's GPU attention and
output-layer fixes and XLA:CPU's transposed weight gradients were found (benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import tempfile
import time

from common import compile_step, random_batch, use_layout_devices
from pjax.malloc import restart_with_huge_pages

# XLA:CPU's executor and waiting, not work: left out of the CPU sums.
CPU_NOT_WORK = ("ThunkExecutor", "Rendezvous", "Wait", "conditional", "while", "call", "SlinkyThreadPool")


def op_times(path: str) -> tuple[dict[str, float], dict[str, int]]:
    """Total nanoseconds and count per op name over the trace's device work."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if gpu and "stream" not in line.name.lower():
                continue
            if not gpu and not line.name.startswith("tf_XLAEigen"):
                continue
            for event in line.events:
                if not gpu and event.name.startswith(CPU_NOT_WORK):
                    continue
                total[event.name] += event.duration_ns
                count[event.name] += 1
    return total, count


def kind(name: str) -> str:
    """'ynn_fusion.94' -> 'ynn_fusion'; GPU kernel names keep their first 60 characters."""
    return re.sub(r"[._]\d+$", "", name)[:60]


def main() -> None:
    restart_with_huge_pages()  # as pjax.train runs (pjax/malloc.py); JAX is not imported yet
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="picotron-cpu")
    ap.add_argument("--layout", default="1")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("overrides", nargs="*", help="config overrides, as for pjax.train")
    args = ap.parse_args()

    use_layout_devices(args.layout)
    import jax

    built = compile_step(args.config, args.layout, args.overrides)
    trainer = built["trainer"]
    batch = random_batch(trainer)
    state = trainer.init(jax.random.key(0))
    for _ in range(2):  # warm: the first calls allocate and autotune
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as trace_dir:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                state, metrics = trainer.step(state, batch)
            jax.block_until_ready(metrics)
        step_ms = (time.perf_counter() - t0) / args.steps * 1000
        total, count = op_times(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    per_step = lambda ns: round(ns / args.steps / 1e6, 2)
    kinds, kind_count = collections.Counter(), collections.Counter()
    for name, ns in total.items():
        kinds[kind(name)] += ns
        kind_count[kind(name)] += count[name]
    print(json.dumps({
        "config": args.config, "layout": args.layout, "device": jax.devices()[0].device_kind,
        "step_ms_traced": round(step_ms, 1), "busy_ms_per_step": per_step(sum(total.values())),
        "kinds": [{"kind": k, "ms": per_step(ns), "per_step": kind_count[k] // args.steps}
                  for k, ns in kinds.most_common(args.top)],
        "ops": [{"op": n[:120], "ms": per_step(ns), "per_step": count[n] // args.steps}
                for n, ns in total.most_common(args.top)],
    }, indent=1))


if __name__ == "__main__":
    main()
