"""Calibration: what the planner's roofline needs, measured on the machine at hand.

    python -m pjax.plan.calibrate --out calibration.json      # about a minute on one GPU or on 2 CPU cores

Matmul throughput as a function of shape and dtype, memory bandwidth, causal attention (forward and
backward, the kernel `train.attention=auto` picks), and each collective's time by size over the devices
present (none on one device). Every figure is the median of timed calls of one compiled program, after a
warm-up; a matmul is timed as a scan over `repeat` different weights, so one call's dispatch is spread
over several products and XLA cannot hoist a product out of the loop.
"""
from __future__ import annotations

import argparse
import datetime
import json
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
_DTYPES = {"cpu": ("float32",), "gpu": ("bfloat16", "float8_e4m3fn")}


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


def matmul(m: int, k: int, n: int, dtype: str, repeat: int = 4) -> dict[str, Any]:
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

    seconds = timed(products.lower(x, ws).compile(), x, ws) / repeat
    return {"m": m, "k": k, "n": n, "dtype": dtype, "seconds": seconds, "flops_per_s": 2 * m * k * n / seconds}


def bandwidth(megabytes: int) -> dict[str, Any]:
    """Bytes per second of an elementwise pass (read once, written once) over `megabytes` of fp32."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    step = jax.jit(lambda x: x * 1.0001 + 1.0).lower(x).compile()
    seconds = timed(step, x)
    return {"megabytes": megabytes, "seconds": seconds, "bytes_per_s": 2 * x.nbytes / seconds}


def attention(batch: int, seq: int, heads: int, head_dim: int) -> dict[str, Any]:
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
    fwd = timed(forward.lower(q, k, v).compile(), q, k, v)
    fwd_bwd = timed(both.lower(q, k, v).compile(), q, k, v)
    return {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "dtype": str(jnp.dtype(dtype)),
            "forward_s": fwd, "forward_backward_s": fwd_bwd,
            "forward_flops_per_s": flops / fwd, "forward_backward_flops_per_s": 3 * flops / fwd_bwd}


def collective(kind: str, megabytes: float, devices: list) -> dict[str, Any]:
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
    seconds = timed(jax.jit(body).lower(x).compile(), x)
    return {"kind": kind, "devices": n, "megabytes": per_device * 4 / 2**20, "seconds": seconds}


def calibrate(quick: bool = False, verbose: bool = False) -> dict[str, Any]:
    """Every measurement above for this machine's platform, as one JSON-able record."""
    plat = _platform()
    grid, devices = _GRIDS[plat], jax.devices()
    rows = grid["rows"][:2] if quick else grid["rows"]
    shapes = [(k, k) for k in grid["square"]] + list(grid["rect"])
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "platform": plat, "device_kind": devices[0].device_kind,
        "devices": len(devices), "jax": jax.__version__, "matmul": [], "attention": [], "collectives": []}
    for dtype in _DTYPES[plat]:
        for m in rows:
            for k, n in shapes:
                try:
                    record["matmul"].append(matmul(m, k, n, dtype))
                    if verbose:
                        print(json.dumps(record["matmul"][-1]), file=sys.stderr, flush=True)
                except Exception as e:  # a dtype this device cannot multiply (fp8 before Hopper) is recorded as such
                    record["matmul"].append({"m": m, "k": k, "n": n, "dtype": dtype, "error": str(e).splitlines()[0]})
    record["bandwidth"] = [bandwidth(mb) for mb in _BANDWIDTH_MB[plat]]
    record["attention"] = [attention(*shape) for shape in _ATTENTION[plat]]
    if verbose:
        print(json.dumps(record["bandwidth"] + record["attention"]), file=sys.stderr, flush=True)
    if len(devices) > 1:
        for kind in ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"):
            for mb in _COLLECTIVE_MB:
                record["collectives"].append(collective(kind, mb, devices))
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the record to this JSON file (also printed)")
    ap.add_argument("--quick", action="store_true", help="fewer matmul row counts")
    ap.add_argument("--verbose", action="store_true", help="each measurement on stderr as it is taken")
    args = ap.parse_args()
    t0 = time.perf_counter()
    record = calibrate(args.quick, args.verbose)
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
