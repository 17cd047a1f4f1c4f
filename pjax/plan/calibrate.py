"""Calibration: what the planner's roofline needs, measured on the machine at hand.

    python -m pjax.plan.calibrate --out calibration.json      # ~25 s on 2 CPU cores as 8 devices
    python -m pjax.plan.calibrate --config smollm-360m train.batch_size=32   # + that step's own products
    python -m pjax.plan.calibrate --config picotron-cpu --only pipeline,stream # what a pipeline, tp pay here

Matmul throughput as a function of shape and dtype, memory bandwidth, causal attention (forward and
backward, the kernel `train.attention=auto` picks), and each collective's time by size within groups of
2, 4, ... of the devices present, every group at once as a mesh axis runs it (none on one device). Every
program is compiled first, in parallel threads on a GPU host (XLA:GPU autotunes each matmul shape for
seconds), then each is timed alone: a figure is the median of timed samples after a warm-up, a sample being
one call on a CPU and 8 calls queued back to back on a GPU (`timed`); a matmul is timed as several independent
products in one call (`matmul_job`), so that one call's dispatch is spread over them.
With a config, also what that model's step pays for a pipeline of 2 stages here (`pipeline_cost`), and what
its tp repeats on each device, the residual stream's work (`stream_cost`).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax

from pjax.plan.measurements import (Job, attention_job, bandwidth_job, collective_groups, collective_job,
                                    matmul_job, model_products, platform)
from pjax.plan.pipeline_cost import measure_pipeline
from pjax.plan.profiles import of_kind
from pjax.plan.stream_cost import measure_stream
from pjax.platforms import missing_gpu, start_platforms

# (rows, contraction, columns) per platform: a CPU's peak is ~1000x below an H100's, so its grid is smaller.
_GRIDS = {
    "cpu": {"rows": (256, 1024, 4096), "square": (64, 128, 256, 512, 1024), "rect": ((256, 1024), (1024, 256))},
    "gpu": {"rows": (2048, 16384, 4096), "square": (512, 1024, 2048, 4096, 8192),
            "rect": ((960, 2560), (2560, 960), (2048, 8192), (8192, 2048), (2048, 49152), (4096, 14336))},
}
_ATTENTION = {"cpu": ((2, 256, 4, 64), (2, 1024, 4, 64)),
              "gpu": ((8, 2048, 16, 64), (4, 4096, 16, 64), (8, 2048, 32, 128), (2, 8192, 32, 128))}
_BANDWIDTH_MB = {"cpu": (16, 256), "gpu": (64, 1024)}
_COLLECTIVE_MB = (0.0625, 1, 16)  # per device
_COLLECTIVES = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
# fp8 is opt-in (`--dtypes bfloat16,float8_e4m3fn`): XLA:GPU autotunes an fp8 dot ~10x longer than a bf16 one.
_DTYPES = {"cpu": ("float32",), "gpu": ("bfloat16",)}


def timed(fn: Callable[..., Any], *args: Any, calls: int = 5, chain: int = 1) -> float:
    """Median seconds per call of an already compiled `fn` over `calls` samples, after one warm-up call; each
    sample queues `chain` calls back to back and waits once, so that the host dispatches the next call while
    the device runs this one, as it does between the ops of a step."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        for _ in range(chain):
            out = fn(*args)  # the previous output is dropped: freed once its call is done, not held to the end
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / chain)
    return statistics.median(times)


# Calls per timed sample. A GPU call waited on alone pays its launch and the wait, which a step's back-to-back
# kernels do not (on an H200, 4 products of [2048, 960] x [960, 2560] per call ran at 167 TFLOP/s so, 32 at
# 272); forced CPU devices keep one call, the way their figures in benchmarks/README.md were taken.
_CHAIN = {"cpu": 1, "gpu": 8}


def run_jobs(jobs: list[Job], threads: int, verbose: bool = False) -> list[dict]:
    """Compile every job's programs (in `threads` parallel threads), then time them one at a time. A program
    this device cannot compile (fp8 before Hopper) leaves its record with an `error` instead of figures."""
    programs = [(i, fn, args) for i, (_, fns, _) in enumerate(jobs) for fn, args in fns]

    def compile_one(item):
        i, fn, args = item
        try:
            return i, fn.lower(*jax.eval_shape(args)).compile(), args.lower().compile()
        except Exception as e:  # noqa: BLE001 - recorded, the calibration goes on
            return i, (str(e).strip().splitlines() or [type(e).__name__])[0], args
    t0, compiled = time.perf_counter(), []
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for done in pool.map(compile_one, programs):
            compiled.append(done)
            if verbose:
                print(f"compiled {len(compiled)}/{len(programs)} in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
    by_job: dict[int, list] = collections.defaultdict(list)
    for i, exe, args in compiled:
        by_job[i].append((exe, args))
    records = []
    for i, (fixed, _, finish) in enumerate(jobs):
        rec, errors = dict(fixed), [exe for exe, _ in by_job[i] if isinstance(exe, str)]
        if errors:
            rec["error"] = errors[0]
        else:
            finish(rec, [timed(exe, *args(), chain=_CHAIN[platform()]) for exe, args in by_job[i]])
        records.append(rec)
        if verbose:
            print(json.dumps(rec), file=sys.stderr, flush=True)
    return records


def default_threads() -> int:
    """Parallel compiles: up to 16 on a GPU host; one on forced CPU devices, where a compile thread takes a
    core from the measurement's own threads."""
    return min(16, os.cpu_count() or 1) if platform() == "gpu" else 1


SECTIONS = ("matmul", "bandwidth", "attention", "collectives", "pipeline", "stream")  # the last two: a config
STEPS = ("pipeline", "stream")  # sections that time the model's own steps
# Raised when a section is measured differently or added (2: the pipeline against a flat step of the same
# products; 3: the stream section), so that `this_machine` measures again rather than read a cached record of
# another form.
FORM = 3


def calibrate(quick: bool = False, verbose: bool = False, threads: int | None = None,
              dtypes: tuple[str, ...] | None = None, config: str | None = None,
              only: tuple[str, ...] = SECTIONS, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Every measurement above for this machine's platform (the `only` sections), as one JSON-able record;
    `config` (with `overrides`): that model's own products too (`model_products`), what its step pays for a
    pipeline here (`pipeline_cost.measure_pipeline`) and what its tp repeats (`stream_cost.measure_stream`;
    without a config there is no model to measure)."""
    plat = platform()
    grid, devices = _GRIDS[plat], jax.devices()
    rows = grid["rows"][:2] if quick else grid["rows"]
    shapes = [(m, k, n) for m in rows for k, n in [(k, k) for k in grid["square"]] + list(grid["rect"])]
    shapes += model_products(config, overrides) if config and "matmul" in only else []
    threads = threads or default_threads()
    makers = {
        "matmul": lambda: [matmul_job(*s, dtype) for dtype in dtypes or _DTYPES[plat] for s in dict.fromkeys(shapes)],
        "bandwidth": lambda: [bandwidth_job(mb) for mb in _BANDWIDTH_MB[plat]],
        "attention": lambda: [attention_job(*shape) for shape in _ATTENTION[plat]],
        "collectives": lambda: [collective_job(kind, mb, devices, g) for g in collective_groups(len(devices))
                                for kind in _COLLECTIVES for mb in _COLLECTIVE_MB]}
    sections = {name: makers[name]() for name in makers if name in only}
    jobs = [job for section in sections.values() for job in section]
    records = iter(run_jobs(jobs, threads, verbose))
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "form": FORM, "platform": plat,
        "device_kind": devices[0].device_kind, "devices": len(devices), "jax": jax.__version__,
        "compile_threads": threads, "config": config, "overrides": list(overrides)}
    for name, section in sections.items():
        record[name] = [next(records) for _ in section]
    if config:  # after the jobs: their operands are gone, the steps have the memory
        for name, measure in (("pipeline", measure_pipeline), ("stream", measure_stream)):
            if name in only:
                record[name] = measure(config, overrides)
    return record


def this_machine(kind: str, cache_dir: str | None, config: str | None = None, overrides: Sequence[str] = ()
                 ) -> tuple[dict[str, Any], str | None, bool]:
    """(record, its file, measured now) of this machine's calibration for planning `config` (with `overrides`:
    its products and pipeline are measured too) on device kind `kind`: read from `cache_dir` where one was
    taken with the same devices, JAX, cores, config and `FORM`, else measured now and stored there. ValueError where
    this machine's devices are not of that kind."""
    devices = jax.devices()
    local = "cpu" if devices[0].platform == "cpu" else devices[0].device_kind
    if not of_kind(kind, local):
        raise ValueError(f"--calibrate measures this machine's devices ({len(devices)} x {local}), not {kind}'s: "
                         f"plan for them here, or calibrate on a {kind} and pass --calibration FILE")
    key = hashlib.sha256(json.dumps([local, len(devices), jax.__version__, os.cpu_count(), config,
                                     list(overrides), FORM]).encode()).hexdigest()
    path = os.path.join(cache_dir, f"{kind}-{len(devices)}-{key[:16]}.json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f), path, False
    record = calibrate(config=config, overrides=overrides)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(record, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    return record, path, True


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = argparse.ArgumentParser(prog="python -m pjax.plan.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the record to this JSON file (also printed)")
    ap.add_argument("--quick", action="store_true", help="fewer matmul row counts")
    ap.add_argument("--threads", type=int, default=None,
                    help="parallel compiles (default: up to 16 on a GPU host, 1 with forced CPU devices)")
    ap.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes (default: the platform's)")
    ap.add_argument("--config", default=None, help="also time this named config's own matmul shapes")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--verbose", action="store_true", help="each measurement on stderr as it is taken")
    ap.add_argument("overrides", nargs="*", help="with --config: its overrides (train.batch_size=32 ...)")
    return ap


def main() -> None:
    start_platforms()  # the CPU where JAX's CUDA plugin finds no GPU: no plugin traceback before the figures
    if missing_gpu():
        sys.exit(f"error: {missing_gpu()}")
    args = parser().parse_args()
    only = tuple(args.only.split(",")) if args.only else SECTIONS
    if not set(only) <= set(SECTIONS) or (args.config and not {"matmul", *STEPS} & set(only)):
        sys.exit(f"--only takes {', '.join(SECTIONS)} (matmul, pipeline or stream with --config); not {args.only}")
    if args.only and set(STEPS) & set(only) and not args.config:
        sys.exit(f"--only {args.only} measures a model's step: give it --config NAME [overrides]")
    t0 = time.perf_counter()
    record = calibrate(args.quick, args.verbose, args.threads,
                       tuple(args.dtypes.split(",")) if args.dtypes else None, args.config, only, args.overrides)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    best = max((r for r in record.get("matmul", []) if "flops_per_s" in r), key=lambda r: r["flops_per_s"],
               default=None)
    print(json.dumps({"device_kind": record["device_kind"], "wall_s": record["wall_s"],
                      "best_matmul_tflops": best and round(best["flops_per_s"] / 1e12, 1), "best_shape": best,
                      "bandwidth_gb_s": [round(b["bytes_per_s"] / 1e9) for b in record.get("bandwidth", [])],
                      **{name: _steps_line(record, name, only) for name in STEPS}}))


def _steps_line(record: dict[str, Any], name: str, only: tuple[str, ...] = SECTIONS) -> str:
    """A section that times two steps (`STEPS`) in a few words: how they compare, or why it was not measured."""
    measured = record.get(name)
    if name not in only:
        return "not asked for (--only)"
    if measured is None:
        return "not measured: it times a model's step, give --config NAME"
    if "error" in measured:
        return f"not measured: {measured['error']}"
    slow, fast = ("pipeline", "flat") if name == "pipeline" else ("plain", "split")
    return (f"{measured[slow]} took {100 * (measured[slow + '_s'] / measured[fast + '_s'] - 1):+.1f}% over "
            f"{measured[fast]} ({measured[slow + '_s'] * 1e3:,.0f} against {measured[fast + '_s'] * 1e3:,.0f} ms)")


if __name__ == "__main__":
    main()
