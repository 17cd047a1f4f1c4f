"""Pipeline benchmark: per schedule and (p, m, v), the step time, bubble, memory and transfer volume.

    python benchmarks/pipeline.py [--pp 2 4] [--mult 1 2 4] [--v 2] [--cp 2] [--remat full] [--plot DIR] > pipeline.json

For every schedule (afab, 1f1b, 1f1b_lockstep, interleaved by default; zb_h1 and zb_v on request,
zb_v with two chunks per device) and pp in --pp, m = k * pp for k in
--mult: one JSON record with the step time (median of --steps AdamW steps), the bubble fraction
read from the schedule table (and the papers' formula, `bubble_formula`), the table's span (its
time when each tick lasts as long as its slowest item, forward 1 and backward 2, or 1 each for
B and W), the slots a device keeps in flight, the compiled
step's per-device temporary memory (`memory_analysis()`), and the collective-permute bytes a
device receives per step, read from the compiled HLO (ops inside the tick loop count once per
tick, whether they run or not) and from the table (`table_transfer_bytes`). The schedule
tables are printed as text on stderr; --plot DIR also saves them as PNGs.

On forced CPU devices all "devices" share the host's cores, so the step time measures the total
work plus per-tick overhead, not the bubble: read the bubble from the table, time on GPUs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax

from mesh import MeshConfig
from mesh.distributed import pipeline_cpu_threads

jax.config.update("jax_num_cpu_devices", 8)  # only the CPU backend is affected; before any device use
pipeline_cpu_threads(MeshConfig(pp=2), 8)  # every run here pipelines: the pool pjax.train gives 8 devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mesh import make_mesh  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from pjax.config import PipelineConfig, TrainConfig  # noqa: E402
from pjax.observe.hlo import collective_stats  # noqa: E402
from pjax.parallel.pipeline import schedules as ps  # noqa: E402
from pjax.observe.pictures import plot_schedule  # noqa: E402
from pjax.parallel.context.zigzag import zigzag_layout  # noqa: E402
from pjax.parallel.pipeline.buffers import buffer_plan  # noqa: E402
from pjax.parallel.pipeline.table import make_schedule  # noqa: E402
from pjax.step import add_positions, build_trainer  # noqa: E402

def permute_bytes(hlo: str) -> int:
    """Bytes a device receives through collective-permutes per step (the tick loop x its trip count)."""
    return collective_stats(hlo)["collective-permute"]["bytes"]


def bench(cfg: LlamaConfig, tc: TrainConfig, mesh_cfg: MeshConfig, pipeline: PipelineConfig, steps: int) -> dict:
    mesh = make_mesh(mesh_cfg, jax.devices()[: mesh_cfg.dp * mesh_cfg.pp * mesh_cfg.cp * mesh_cfg.tp])
    tr = build_trainer(mesh, cfg, tc, pipeline)
    state = tr.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (tc.grad_accum, tc.batch_size // tc.grad_accum, tc.seq_len + 1))
    batch = add_positions({"inputs": jnp.asarray(tokens[..., :-1], jnp.int32),
                           "labels": jnp.asarray(tokens[..., 1:], jnp.int32)})
    cols = np.asarray(zigzag_layout(mesh_cfg.cp)(np.arange(tc.seq_len)))  # ring attention's column order
    batch = {k: a[..., cols] for k, a in batch.items()}
    batch = jax.device_put(batch, tr.batch_sharding)
    t0 = time.perf_counter()
    compiled = tr.compile_step(state, batch)
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    record = {"schedule": pipeline.schedule if mesh_cfg.pp > 1 else "none", "p": mesh_cfg.pp, "m": tc.grad_accum,
              "v": pipeline.virtual_stages, "remat": tc.remat, "dp": mesh_cfg.dp, "cp": mesh_cfg.cp, "tp": mesh_cfg.tp,
              "step_time_ms": 1e3 * statistics.median(times), "compile_s": compile_s,
              "temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
              "loss": float(metrics["loss"])}
    if mesh_cfg.pp > 1:
        sched = run_schedule(pipeline, mesh_cfg, tc.grad_accum)
        p, m, v = sched.p, sched.m, sched.v
        record.update(ticks=sched.ticks, bubble_fraction=sched.bubble_fraction(), span_units=sched.span(),
                      bubble_formula=bubble_formula(pipeline.schedule, p, m, v), slots=buffer_plan(sched).slots,
                      collective_permute_bytes_per_step=permute_bytes(compiled.as_text()),
                      table_transfer_bytes_per_step=table_transfer_bytes(sched, tc, cfg))
    return record


def table_transfer_bytes(sched: ps.Schedule, tc: TrainConfig, cfg: LlamaConfig) -> int:
    """Bytes the busiest device receives per step by the table: its arrivals (activations and
    cotangents, every lane, the last ZB-V device's to itself included) times one micro-batch's
    hidden states. The HLO count
    (`permute_bytes`) counts every permute loop on every tick, run or not: an upper bound that
    grows with the pair sets a table needs (ZB-V's lanes)."""
    plan = buffer_plan(sched)
    arrivals = (plan.recv_x != plan.slots).sum(axis=(0, 2)) + (plan.recv_dy != plan.slots).sum(axis=(0, 2))
    return int(arrivals.max()) * (tc.batch_size // tc.grad_accum) * tc.seq_len * cfg.hidden_size * 4


def bubble_formula(schedule: str, p: int, m: int, v: int) -> float:
    """The papers' bubble fraction: 1F1B-like tables (p - 1)/(v m + p - 1); ZB-H1 with F, B and W
    one tick each (p - 1)/(3m + p - 1); ZB-V, with ticks of half a stage, (p - 1)/(6m + p - 1)."""
    if schedule == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zb_v":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def run_schedule(pipeline: PipelineConfig, mesh_cfg: MeshConfig, m: int) -> ps.Schedule:
    """The table the executor runs: in lockstep when cp > 1 (ring attention inside the stages)."""
    return make_schedule(pipeline, mesh_cfg.pp, m, lockstep=mesh_cfg.cp > 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mult", type=int, nargs="+", default=[1, 2, 4], help="m = mult * pp micro-batches")
    ap.add_argument("--v", type=int, default=2, help="virtual stages of the interleaved schedule (zb_v takes 2)")
    ap.add_argument("--schedules", nargs="+", default=["afab", "1f1b", "1f1b_lockstep", "interleaved"])
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallelism inside the stages (lockstep tables)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro_batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--remat", default="none", help="train.remat for every run (full: keep only the layer inputs)")
    ap.add_argument("--plot", default=None, help="a directory for PNGs of the schedule tables")
    args = ap.parse_args(argv)

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
    base = TrainConfig(seq_len=args.seq_len, dtype="float32", steps=1000, warmup_steps=1, remat=args.remat)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
    results, baselines = [], set()
    for p in args.pp:
        for m in (k * p for k in args.mult):
            tc = dataclasses.replace(base, batch_size=m * args.micro_batch, grad_accum=m)
            if m not in baselines:  # the same global batch without a pipeline, on dp*tp devices
                baselines.add(m)
                results.append(bench(cfg, tc, MeshConfig(dp=args.dp, pp=1, cp=args.cp, tp=args.tp), PipelineConfig(),
                                     args.steps))
                print(json.dumps(results[-1]), file=sys.stderr)
            for name in args.schedules:
                v = {"interleaved": args.v, "zb_v": 2}.get(name, 1)
                pipeline = PipelineConfig(schedule=name, virtual_stages=v)
                mesh_cfg = MeshConfig(dp=args.dp, pp=p, cp=args.cp, tp=args.tp)
                sched = run_schedule(pipeline, mesh_cfg, m)
                print(sched.render(), file=sys.stderr)
                if args.plot:
                    plot_schedule(sched, os.path.join(args.plot, f"{name}_p{p}_m{m}_v{sched.v}.png"))
                record = bench(cfg, tc, mesh_cfg, pipeline, args.steps)
                print(json.dumps(record), file=sys.stderr)
                results.append(record)
    print(json.dumps({"model": dataclasses.asdict(cfg), "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                      "device": jax.devices()[0].device_kind, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
