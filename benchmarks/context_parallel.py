"""Context-parallel benchmark: per-device memory, step time and cp traffic of each context.strategy
(ring, all_gather, ulysses) against sequence length.

    python benchmarks/context_parallel.py                      # seq 256..2048, cp 1, 2, 4, 8, three strategies
    python benchmarks/context_parallel.py --seq 1024 4096 --cp 1 8 --strategy ring --plot cp.png
    python benchmarks/context_parallel.py --set model.num_attention_heads=8   # any config override

For each sequence length, cp and strategy (dp = 1, so a mesh of cp devices; cp = 1 once, with no
strategy) it compiles the real train step of a small LLaMA (the debug config's shape, fp32,
zigzag batches) and prints one JSON document:
  * memory_mb: per-device argument + output - aliased + temporary bytes of the compiled step
    (XLA:CPU's own peak figure is just the arguments);
  * step_ms: median wall time of a few executed steps. On forced CPU devices every "device"
    shares the host's cores, so this shows overheads, not the speed-up cp gives on accelerators;
  * cp_mb: bytes a device sends per step for the strategy's own collectives (ring permutes; the
    all-gathers and reduce-scatters of all_gather; the all-to-alls of ulysses), read from the
    compiled HLO (loop bodies times their trip counts) and converted to link bytes as `pjax.observe.hlo`
    does, next to cp_mb_analytic: the formula of `analytic_cp_bytes`;
  * reshard_mb: other permutes and all-to-alls, which XLA's partitioner inserts to move
    activations between layouts. They appear when a device holds more than one sequence per
    micro-batch (--batch_size > 1 here): the model's flattened [batch*seq] activations split over
    (dp, cp) are then not "each row's cp-th chunk", and every [batch*seq] <-> [batch, seq]
    reshape around attention reshuffles them.
Strategy and cp pairs the model cannot run (Ulysses needs heads divisible by cp) print their
one-line error instead.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

from pjax.observe.hlo import collective_stats, device_groups, link_factor  # plain text parsing: imports no JAX

STRATEGIES = ("ring", "all_gather", "ulysses")
_OWN = re.compile(r'op_name="[^"]*/(ppermute|all_gather|reduce_scatter|all_to_all)"')


def _own_or_reshard(cp: int):
    """classify(kind, line) for collective_stats: ('cp', link factor) for the strategy's own
    collectives (named by the lax primitive in the op's metadata), ('reshard', 1) for permutes
    and all-to-alls XLA's partitioner inserts; other collectives (the gradients' all-reduce) None."""
    def classify(kind: str, line: str):
        if _OWN.search(line):
            size = 2 if kind == "collective-permute" else max(len(g) for g in device_groups(line, cp))
            return "cp", link_factor(kind, size)
        return ("reshard", 1.0) if kind in ("collective-permute", "all-to-all") else None
    return classify


def collective_bytes(hlo: str, cp: int) -> dict[str, float]:
    """Link bytes one device sends per step through the strategy's collectives and through reshards."""
    out = {"cp": 0.0, "reshard": 0.0}
    for label, stats in collective_stats(hlo, _own_or_reshard(cp)).items():
        if isinstance(label, tuple):
            out[label[0]] += stats["bytes"] * label[1]
    return out


def analytic_cp_bytes(cfg: Any, cp: int, strategy: str, dtype_bytes: int) -> float:
    """Link bytes per device per step of one strategy: the planner's formula
    (`pjax.plan.estimate.cp_bytes`, whose docstring says what each strategy sends), over the
    layers and micro-batches. On the CPU, Ulysses' gather of the positions is dropped by XLA:
    the blocked attention does not read them."""
    from pjax.plan.estimate import cp_bytes
    from pjax.plan.layouts import Layout

    if cp == 1:
        return 0
    tc = cfg.train
    tokens = tc.batch_size // tc.grad_accum * tc.seq_len // cp
    per_layer = cp_bytes(cfg, Layout(dp=1, cp=cp, context=strategy), tokens, dtype_bytes)[1]
    return cfg.model.num_hidden_layers * tc.grad_accum * per_layer


def measure(seq_len: int, cp: int, strategy: str, batch_size: int, steps: int, overrides: list[str]) -> dict[str, Any]:
    import jax
    import numpy as np

    from mesh import MeshConfig, make_mesh
    from pjax.config_io import load_config
    from pjax.parallel.context.zigzag import zigzag_layout
    from mesh.errors import ConfigError
    from pjax.step import build_trainer

    cfg = load_config("debug", [f"train.seq_len={seq_len}", f"train.batch_size={batch_size}", "train.grad_accum=1",
                                "train.dtype=float32", f"context.strategy={strategy}", *overrides])
    mc, tc = cfg.model, cfg.train
    mesh = make_mesh(MeshConfig(dp=1, cp=cp), jax.devices()[:cp])
    row = {"seq_len": seq_len, "cp": cp, "strategy": strategy if cp > 1 else None}
    try:
        trainer = build_trainer(mesh, mc, tc, context=cfg.context)
    except ConfigError as e:
        return {**row, "error": str(e)}
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
    traffic = collective_bytes(compiled.as_text(), cp)
    analytic = analytic_cp_bytes(cfg, cp, strategy, dtype_bytes=4)
    mb = lambda n: round(n / 2**20, 3)
    return {
        **row,
        "memory_mb": mb(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                        + mem.temp_size_in_bytes),
        "temp_mb": mb(mem.temp_size_in_bytes),
        "step_ms": round(1000 * statistics.median(times[1:]), 1),
        "cp_mb": mb(traffic["cp"]),
        "cp_mb_analytic": mb(analytic),
        "reshard_mb": mb(traffic["reshard"]),
        "loss": round(float(metrics["loss"]), 4),
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Memory, step time and cp traffic against sequence length: a colour per cp, a line style per strategy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = [r for r in results if "error" not in r]
    styles = {None: "-", "ring": "-", "all_gather": "--", "ulysses": ":"}
    fig = Figure(figsize=(15, 4))
    panels = (("memory_mb", "per-device memory (MiB)"), ("step_ms", "step (ms)"), ("cp_mb", "cp traffic (MiB per device)"))
    for ax, (key, label) in zip(fig.subplots(1, 3), panels):
        for n, cp in enumerate(sorted({r["cp"] for r in results})):
            for strategy in dict.fromkeys(r["strategy"] for r in results if r["cp"] == cp):
                rows = [r for r in results if r["cp"] == cp and r["strategy"] == strategy and r[key] > 0]
                ax.plot([r["seq_len"] for r in rows], [r[key] for r in rows], marker="o", color=f"C{n}",
                        linestyle=styles[strategy], label=f"cp={cp}" + (f" {strategy}" if strategy else ""))
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. model.num_attention_heads=8")
    ap.add_argument("--plot", default=None, help="write memory, step time and traffic against sequence length to this PNG")
    args = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.cp))  # CPU only; accelerators stay as they are
    results = []
    for cp in args.cp:
        for strategy in args.strategy if cp > 1 else args.strategy[:1]:
            for seq in args.seq:
                results.append(measure(seq, cp, strategy, args.batch_size, args.steps, args.set))
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"device": jax.devices()[0].device_kind, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
