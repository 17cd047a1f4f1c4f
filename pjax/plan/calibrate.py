"""Calibration: what the planner's roofline needs, measured on the machine at hand.

    python -m pjax.plan.calibrate --out calibration.json      # ~35 s on one H200, ~20 s on 2 CPU cores

Matmul throughput as a function of shape and dtype, memory bandwidth, causal attention (forward and
backward, the kernel `train.attention=auto` picks), and each collective's time by size over the devices
present (none on one device). Every program is compiled first, in parallel threads on a GPU host (XLA:GPU
autotunes each matmul shape for seconds), then each is timed alone: a figure is the median of timed calls
after a warm-up; a matmul is timed as a scan over `repeat` different weights, so one call's dispatch is spread
over several products and XLA cannot hoist a product out of the loop.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def timed(fn: Callable[..., Any], *args: Any, calls: int = 5) -> float:
    """Median seconds of `calls` calls of an already compiled `fn`, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _platform() -> str:
    return "gpu" if jax.default_backend() == "gpu" else "cpu"


# A measurement is a Job: its record's fixed fields, the jitted programs it times with their arguments,
# and how the timed seconds complete the record. Jobs are compiled together first (XLA:GPU's autotuning
# costs seconds per shape, and compiles run in parallel threads), then timed one at a time.
Job = tuple[dict, list[tuple[Callable, tuple]], Callable[[dict, list[float]], None]]


def matmul_job(m: int, k: int, n: int, dtype: str, repeat: int = 4) -> Job:
    """One [m, k] x [k, n] product's seconds and FLOP/s, as the mean over a scan of `repeat` products."""
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    ws = jax.random.normal(keys[1], (repeat, k, n), jnp.float32).astype(dtype)
    out = jnp.bfloat16 if "float8" in dtype else dtype

    @jax.jit
    def products(x, ws):
        def one(acc, w):
            return acc + jnp.dot(x, w, preferred_element_type=out), None
        return jax.lax.scan(one, jnp.zeros((m, n), out), ws)[0]

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"] = secs[0] / repeat
        rec["flops_per_s"] = 2 * m * k * n / rec["seconds"]
    return {"m": m, "k": k, "n": n, "dtype": dtype}, [(products, (x, ws))], finish


def bandwidth_job(megabytes: int) -> Job:
    """Bytes per second of an elementwise pass (read once, written once) over `megabytes` of fp32."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"], rec["bytes_per_s"] = secs[0], 2 * x.nbytes / secs[0]
    return {"megabytes": megabytes}, [(jax.jit(lambda x: x * 1.0001 + 1.0), (x,))], finish


def attention_job(batch: int, seq: int, heads: int, head_dim: int) -> Job:
    """Causal attention's forward and forward + backward seconds with the kernel `auto` picks, and the model
    FLOP/s they stand for (QK^T and PV over half the keys: 4·B·H·T²·D/2 forward, three times that both ways)."""
    from models.attention import select_attention

    dtype = jnp.bfloat16 if _platform() == "gpu" else jnp.float32
    q, k, v = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
               for key in jax.random.split(jax.random.key(1), 3))
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    fn = select_attention("auto")
    forward = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos))
    both = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v, pos, pos).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = 2 * batch * heads * seq * seq * head_dim

    def finish(rec: dict, secs: list[float]) -> None:
        rec["forward_s"], rec["forward_backward_s"] = secs
        rec["forward_flops_per_s"], rec["forward_backward_flops_per_s"] = flops / secs[0], 3 * flops / secs[1]
    fixed = {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "dtype": str(jnp.dtype(dtype))}
    return fixed, [(forward, (q, k, v)), (both, (q, k, v))], finish


def collective_job(kind: str, megabytes: float, devices: list) -> Job:
    """One collective over all `devices` (a 1-D mesh): seconds for a per-device buffer of `megabytes` fp32."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    per_device = max(n, int(megabytes * 2**20 / 4) // n * n)
    ops = {"psum": lambda x: jax.lax.psum(x, "x"),
           "all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
           "psum_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
           "all_to_all": lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
           "ppermute": lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)])}
    body = jax.shard_map(ops[kind], mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    x = jax.device_put(jnp.ones((n * per_device,), jnp.float32), NamedSharding(mesh, P("x")))

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"] = secs[0]
    return {"kind": kind, "devices": n, "megabytes": per_device * 4 / 2**20}, [(jax.jit(body), (x,))], finish


def run_jobs(jobs: list[Job], threads: int, verbose: bool = False) -> list[dict]:
    """Compile every job's programs (in `threads` parallel threads), then time them one at a time. A program
    this device cannot compile (fp8 before Hopper) leaves its record with an `error` instead of figures."""
    programs = [(i, fn, args) for i, (_, fns, _) in enumerate(jobs) for fn, args in fns]

    def compile_one(item):
        i, fn, args = item
        try:
            return i, fn.lower(*args).compile(), args
        except Exception as e:  # noqa: BLE001 - recorded, the calibration goes on
            return i, str(e).splitlines()[0], args
    t0, compiled = time.perf_counter(), []
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for done in pool.map(compile_one, programs):
            compiled.append(done)
            if verbose:
                print(f"compiled {len(compiled)}/{len(programs)} in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
    records, seconds = [dict(fixed) for fixed, _, _ in jobs], [[] for _ in jobs]
    for i, exe, args in compiled:
        if isinstance(exe, str):
            records[i]["error"] = exe
        elif "error" not in records[i]:
            seconds[i].append(timed(exe, *args))
    for rec, secs, (_, _, finish) in zip(records, seconds, jobs):
        if "error" not in rec:
            finish(rec, secs)
        if verbose:
            print(json.dumps(rec), file=sys.stderr, flush=True)
    return records


def calibrate(quick: bool = False, verbose: bool = False, threads: int | None = None,
              dtypes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every measurement above for this machine's platform, as one JSON-able record."""
    plat = _platform()
    grid, devices = _GRIDS[plat], jax.devices()
    rows = grid["rows"][:2] if quick else grid["rows"]
    shapes = [(k, k) for k in grid["square"]] + list(grid["rect"])
    # On forced CPU devices a compile thread takes a core from the measurement's own threads: one at a time.
    threads = threads or (min(16, os.cpu_count() or 1) if plat == "gpu" else 1)
    sections = {
        "matmul": [matmul_job(m, k, n, dtype) for dtype in dtypes or _DTYPES[plat] for m in rows for k, n in shapes],
        "bandwidth": [bandwidth_job(mb) for mb in _BANDWIDTH_MB[plat]],
        "attention": [attention_job(*shape) for shape in _ATTENTION[plat]],
        "collectives": [collective_job(kind, mb, devices) for kind in _COLLECTIVES for mb in _COLLECTIVE_MB]
        if len(devices) > 1 else []}
    jobs = [job for section in sections.values() for job in section]
    records = iter(run_jobs(jobs, threads, verbose))
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "platform": plat, "device_kind": devices[0].device_kind,
        "devices": len(devices), "jax": jax.__version__, "compile_threads": threads}
    for name, section in sections.items():
        record[name] = [next(records) for _ in section]
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the record to this JSON file (also printed)")
    ap.add_argument("--quick", action="store_true", help="fewer matmul row counts")
    ap.add_argument("--threads", type=int, default=None,
                    help="parallel compiles (default: up to 16 on a GPU host, 1 with forced CPU devices)")
    ap.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes (default: the platform's)")
    ap.add_argument("--verbose", action="store_true", help="each measurement on stderr as it is taken")
    args = ap.parse_args()
    t0 = time.perf_counter()
    record = calibrate(args.quick, args.verbose, args.threads,
                       tuple(args.dtypes.split(",")) if args.dtypes else None)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    best = max((r for r in record["matmul"] if "flops_per_s" in r), key=lambda r: r["flops_per_s"])
    print(json.dumps({"device_kind": record["device_kind"], "wall_s": record["wall_s"],
                      "best_matmul_tflops": round(best["flops_per_s"] / 1e12, 1), "best_shape": best,
                      "bandwidth_gb_s": [round(b["bytes_per_s"] / 1e9) for b in record["bandwidth"]]}))


if __name__ == "__main__":
    main()
