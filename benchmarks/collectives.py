"""Ring collectives (pjax.parallel.collectives) against XLA's native ones: time and bus bandwidth.

    python benchmarks/collectives.py                          # one axis of 8 CPU devices, 1 KB .. 16 MB
    python benchmarks/collectives.py --mesh dp=2,cp=2,tp=2    # every axis of a 4D mesh with size > 1
    python benchmarks/collectives.py --max_bytes 64M --plot busbw.png

Sizes follow nccl-tests: for all-reduce and reduce-scatter the size is each device's input, for
all-gather each device's output (its input is size/n). algbw = size / time, and the bus bandwidth
busbw = algbw * 2(n-1)/n (all-reduce) or * (n-1)/n (all-gather, reduce-scatter) is what one link
carries under the optimal ring algorithm, comparable across n. Prints one JSON line per
measurement. On forced CPU devices all "links" are memcpys between threads sharing the host's
cores: compare ring vs native, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import AXES, MeshConfig, make_mesh
from pjax.parallel import collectives as C

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
# Bytes one link carries per byte of `size` under the ring algorithm (nccl-tests' bus factor).
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


def parse_bytes(text: str) -> int:
    """'1024', '4K', '16M', '1G' -> bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (ValueError, IndexError):
        raise ConfigError(f"size {text!r} is not a byte count; write e.g. 1024, 64K or 16M.") from None


def parse_mesh(text: str) -> MeshConfig:
    """'dp=2,cp=2,tp=2' -> MeshConfig (unnamed axes 1)."""
    sizes: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit():
            raise ConfigError(f"--mesh part {part!r} is not axis=size; use e.g. dp=2,cp=2,tp=2 "
                              f"with axes {', '.join(AXES)}.")
        sizes[name] = int(value)
    return MeshConfig(**{"dp": 1, **sizes})


def time_one(fn: Any, x: jax.Array, warmup: int, iters: int) -> tuple[float, jax.Array]:
    """Median seconds per call. Block on every call: with many executions queued, XLA:CPU's
    in-process collectives can miss their rendezvous deadline on a busy 2-core host."""
    for _ in range(warmup):
        out = fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench_axis(mesh: jax.sharding.Mesh, axis: str, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    n = mesh.shape[axis]
    rows = []
    for kind in KINDS:
        for size in sizes:
            per_device = size // n if kind == "all_gather" else size  # each device's input bytes
            elems = max(1, per_device // 4)  # float32
            x = np.random.default_rng(0).standard_normal((n, elems)).astype(np.float32)
            x = jax.device_put(x, NamedSharding(mesh, P(axis)))
            outs = {}
            for impl in ("ring", "xla"):
                fn = C.collective_fn(kind, mesh, axis, impl, **({} if kind == "all_gather" else {"op": "sum"}))
                seconds, outs[impl] = time_one(fn, x, args.warmup, args.iters)
                algbw = size / seconds / 1e9
                row = dict(collective=kind, impl=impl, axis=axis, n=n, bytes=size, time_us=round(seconds * 1e6, 1),
                           algbw_GBps=round(algbw, 3), busbw_GBps=round(algbw * BUS_FACTOR[kind](n), 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
            # Same answer as XLA's, to float rounding (sums in a different order).
            if not np.allclose(np.asarray(outs["ring"]), np.asarray(outs["xla"]), rtol=1e-4, atol=1e-4):
                raise AssertionError(f"ring {kind} differs from XLA's at {size} bytes over {axis}")
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_seen = list(dict.fromkeys(r["axis"] for r in rows))
    fig, panels = plt.subplots(1, len(axes_seen), figsize=(6 * len(axes_seen), 4.5), squeeze=False)
    for panel, axis in zip(panels[0], axes_seen):
        for color, kind in zip(("C0", "C1", "C2"), KINDS):
            for impl, style in (("ring", "-"), ("xla", "--")):
                pts = [(r["bytes"], r["busbw_GBps"]) for r in rows
                       if r["axis"] == axis and r["collective"] == kind and r["impl"] == impl]
                if pts:
                    panel.plot(*zip(*pts), style, color=color, marker="o", ms=3, label=f"{kind} ({impl})")
        n = next(r["n"] for r in rows if r["axis"] == axis)
        panel.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
                  title=f"axis {axis} (n={n}) on {jax.devices()[0].platform}")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="dp=8", help="axis sizes, e.g. dp=8 (default) or dp=2,cp=2,tp=2")
    ap.add_argument("--axes", default=None, help="comma-separated axes to measure (default: every axis of size > 1)")
    ap.add_argument("--cpu_devices", type=int, default=8, help="forced CPU devices (ignored on GPU/TPU)")
    ap.add_argument("--min_bytes", default="1K")
    ap.add_argument("--max_bytes", default="16M", help="largest message (e.g. 64M; mind the host's memory)")
    ap.add_argument("--factor", type=int, default=4, help="size step between messages")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--plot", default=None, help="write bus bandwidth vs size to this PNG")
    args = ap.parse_args(argv)

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before the backend starts
    cfg = parse_mesh(args.mesh)
    mesh = make_mesh(cfg, jax.devices()[:cfg.size])
    axes = args.axes.split(",") if args.axes else [a for a in AXES if mesh.shape[a] > 1]
    if not axes:
        raise ConfigError(f"every axis of --mesh {args.mesh} has size 1; give one axis at least 2 devices.")
    sizes, size = [], parse_bytes(args.min_bytes)
    while size <= parse_bytes(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    print(f"# {' '.join(f'{a}={mesh.shape[a]}' for a in AXES)} over {jax.device_count()} "
          f"{jax.devices()[0].platform} devices; sizes {sizes[0]}..{sizes[-1]} bytes", file=sys.stderr)
    rows = [row for axis in axes for row in bench_axis(mesh, axis, sizes, args)]
    if args.plot:
        plot(rows, args.plot)
        print(f"# wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
