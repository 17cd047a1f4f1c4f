"""How a calibration times a matmul changes the rate it reports: a model's own products, timed two ways.

    python benchmarks/matmul_timing.py --config smollm-360m train.batch_size=32 train.grad_accum=4
    python benchmarks/matmul_timing.py --config smollm-360m --threads 1 --ways independent ...

`carried`: a scan of 4 products that adds each into a carried [m, n] sum (pjax.plan.calibrate's way until
2026-11-27); `independent`: `measurements.matmul_job`'s independent products, each to its own output. The
products are those of the config's step compiled for one device (`measurements.model_products`), each timed
as the calibration times it (`calibrate.run_jobs`: on a GPU, 8 calls queued per sample). Prints one JSON line
per product and way: its shape, the way, the compile threads and TFLOP/s."""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pjax.plan import calibrate, measurements


def carried_job(m: int, k: int, n: int, dtype: str, repeat: int = 4) -> measurements.Job:
    """The earlier way: `repeat` products of one input summed into a carried buffer by a scan."""
    @jax.jit
    def operands() -> tuple:
        keys = jax.random.split(jax.random.key(0), 2)
        return (jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype),
                jax.random.normal(keys[1], (repeat, k, n), jnp.float32).astype(dtype))

    @jax.jit
    def products(x, ws):
        return jax.lax.scan(lambda acc, w: (acc + jnp.dot(x, w, preferred_element_type=dtype), None),
                            jnp.zeros((m, n), dtype), ws)[0]

    def finish(rec: dict, secs: list[float]) -> None:
        rec["seconds"] = secs[0] / repeat
        rec["flops_per_s"] = 2 * m * k * n / rec["seconds"]
    return {"m": m, "k": k, "n": n, "dtype": dtype, "repeat": repeat}, [(products, operands)], finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm-360m")
    ap.add_argument("--ways", default="carried,independent")
    ap.add_argument("--threads", type=int, default=None, help="parallel compiles (default: calibrate's)")
    ap.add_argument("overrides", nargs="*", help="the config's overrides")
    args = ap.parse_args()
    dtype = calibrate._DTYPES[measurements.platform()][0]
    threads = args.threads or calibrate.default_threads()
    makers = {"carried": carried_job, "independent": measurements.matmul_job}
    ways = args.ways.split(",")
    shapes = measurements.model_products(args.config, args.overrides)
    jobs = [makers[way](*shape, dtype) for way in ways for shape in shapes]
    for i, rec in enumerate(calibrate.run_jobs(jobs, threads)):
        rec.update(way=ways[i // len(shapes)], threads=threads, config=args.config,
                   tflops=round(rec.get("flops_per_s", 0) / 1e12, 2))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
