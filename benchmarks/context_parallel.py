"""Context-parallel benchmark: per-device memory, step time and ring traffic against sequence length.

    python benchmarks/context_parallel.py                      # seq 256..2048, cp 1, 2, 4, 8 (CPU: ~3 min)
    python benchmarks/context_parallel.py --seq 1024 4096 --cp 1 8 --plot cp.png

For each sequence length and cp (dp = 1, so a mesh of cp devices) it compiles the real train step
of a small LLaMA (the debug config's shape, fp32, zigzag batches) and prints one JSON document:
  * memory_mb: per-device argument + output - aliased + temporary bytes of the compiled step
    (XLA:CPU's own peak figure is just the arguments);
  * step_ms: median wall time of a few executed steps. On forced CPU devices every "device"
    shares the host's cores, so this shows overheads, not the speed-up cp gives on accelerators;
  * permute_mb: collective-permute bytes per device per step, read from the compiled HLO (loop
    bodies counted times their trip counts), next to permute_mb_analytic: per layer and
    micro-batch, with one K/V block = micro_batch * seq/cp * kv_heads * head_dim elements,
    2(cp-1) block sends forward (K and V), and backward 2(cp-1) again plus 2cp fp32 dK/dV sends;
  * reshard_mb: the other permutes and all-to-alls, which XLA's partitioner inserts to move
    activations between layouts. They appear when a device holds more than one sequence per
    micro-batch (--batch_size > 1 here): the model's flattened [batch*seq] activations split over
    (dp, cp) are then not "each row's cp-th chunk", and every [batch*seq] <-> [batch, seq]
    reshape around attention reshuffles them.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

from pjax.hlo import collective_stats  # plain text parsing: imports no JAX


def _ring_or_reshard(kind: str, line: str) -> str | None:
    """'ring': the `lax.ppermute`s of ring attention; 'reshard': permutes and all-to-alls that XLA's
    partitioner inserts to move activations between shardings; other collectives are left out."""
    if kind == "collective-permute" and re.search(r'op_name="[^"]*/ppermute"', line):
        return "ring"
    return "reshard" if kind in ("collective-permute", "all-to-all") else None


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes one device moves per step through ring permutes and reshards (loops x trip counts)."""
    stats = collective_stats(hlo, _ring_or_reshard)
    return {key: stats[key]["bytes"] if key in stats else 0 for key in ("ring", "reshard")}


def analytic_permute_bytes(cp: int, layers: int, grad_accum: int, micro_batch: int, seq_len: int,
                           kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    block = micro_batch * (seq_len // cp) * kv_heads * head_dim
    if cp == 1:
        return 0
    forward = 2 * (cp - 1) * block * dtype_bytes
    backward = 2 * (cp - 1) * block * dtype_bytes + 2 * cp * block * 4
    return layers * grad_accum * (forward + backward)


def measure(seq_len: int, cp: int, batch_size: int, steps: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from mesh import MeshConfig, make_mesh
    from pjax.config_io import load_config
    from pjax.parallel.context_parallel import zigzag_layout
    from pjax.step import build_trainer

    cfg = load_config("debug", [f"train.seq_len={seq_len}", f"train.batch_size={batch_size}", "train.grad_accum=1",
                                "train.dtype=float32"])
    mc, tc = cfg.model, cfg.train
    mesh = make_mesh(MeshConfig(dp=1, cp=cp), jax.devices()[:cp])
    trainer = build_trainer(mesh, mc, tc)
    tokens = np.random.default_rng(0).integers(0, mc.vocab_size, (1, batch_size, seq_len + 1)).astype(np.int32)
    columns = zigzag_layout(cp)(np.arange(seq_len))
    batch = {"inputs": tokens[..., columns], "labels": tokens[..., columns + 1],
             "positions": np.broadcast_to(columns.astype(np.int32), (1, batch_size, seq_len))}
    batch = jax.device_put(batch, trainer.batch_sharding)
    state = trainer.init(jax.random.key(0))
    compiled = trainer.compile_step(state, batch)
    mem = compiled.memory_analysis()
    times = []
    for _ in range(steps + 1):  # the first run warms up
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    traffic = collective_bytes(compiled.as_text())
    analytic = analytic_permute_bytes(cp, mc.num_hidden_layers, tc.grad_accum, batch_size, seq_len,
                                      mc.num_key_value_heads, mc.head_dim, dtype_bytes=4)
    mb = lambda n: round(n / 2**20, 3)
    return {
        "seq_len": seq_len, "cp": cp,
        "memory_mb": mb(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                        + mem.temp_size_in_bytes),
        "temp_mb": mb(mem.temp_size_in_bytes),
        "step_ms": round(1000 * statistics.median(times[1:]), 1),
        "permute_mb": mb(traffic["ring"]),
        "permute_mb_analytic": mb(analytic),
        "reshard_mb": mb(traffic["reshard"]),
        "loss": round(float(metrics["loss"]), 4),
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    for ax, key, label in zip(fig.subplots(1, 2), ("memory_mb", "step_ms"), ("per-device memory (MiB)", "step (ms)")):
        for cp in sorted({r["cp"] for r in results}):
            rows = [r for r in results if r["cp"] == cp]
            ax.plot([r["seq_len"] for r in rows], [r[key] for r in rows], marker="o", label=f"cp={cp}")
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label)
        ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plot", default=None, help="write memory and step time against sequence length to this PNG")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.cp))  # CPU only; accelerators stay as they are
    results = []
    for cp in args.cp:
        for seq in args.seq:
            results.append(measure(seq, cp, args.batch_size, args.steps))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"device": jax.devices()[0].device_kind, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
