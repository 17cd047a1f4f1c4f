"""What a pipeline pays on this machine beyond its work, measured on the model at hand.

A schedule's table says how long a device idles (the bubble, `estimate.pipeline_ratio`). What the machine
pays for it is another matter. On devices of their own every tick ends in a permute that all of them meet,
so an idle tick lasts as long as the busiest device's item: the whole bubble is paid. On forced CPU devices
that share a host's cores, the stages with work run on the idle stages' cores, so the bubble costs next to
nothing. Either way each tick also does work of its own (the conditionals, the slot writes and reads, the
permutes' rendezvous), which grows with the step's work, not with its bubble: on this host a pipeline's extra
time was about the same share of its step for every schedule (benchmarks/README.md, "What a pipeline pays,
per schedule"). That share is measured whole: the model's own training step at pp = 2 (1F1B, four
micro-batches, the other devices on dp) against the same step without a pipeline at two micro-batches, whose
products have the same shapes and which does the same FLOPs per device. On forced CPU devices each step runs
in a process of its own, started as `pjax.train` starts one (a pipeline's thread pools are sized at
start-up). `pipeline_factor` turns it into what the roofline charges a layout: its work, times the table's
span over busy time where the bubble is paid, times one plus the ticks' share."""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from pjax.plan.layouts import Layout
    from pjax.plan.profiles import Profile

_MICRO_BATCHES = 2  # the flat step's; the pipeline's dp is half, so twice as many give the same products


def _step_seconds(config_name: str, overrides: Sequence[str], layout: Layout, devices: list, steps: int) -> float:
    """The median seconds of `steps` training steps of `layout` on `devices`, after one warm-up step."""
    from mesh.mesh import make_mesh
    from pjax.config_io import load_config
    from pjax.step import build_trainer

    cfg = load_config(config_name, [*overrides, *layout.overrides()])
    trainer = build_trainer(make_mesh(cfg.mesh, devices), cfg.model, cfg.train, cfg.pipeline, cfg.moe,
                            cfg.context, cfg.precision)
    shapes = trainer.abstract_batch()["inputs"].shape

    @functools.partial(jax.jit, out_shardings=trainer.batch_sharding)
    def batch() -> dict:
        tokens = jax.random.randint(jax.random.key(0), (2, *shapes), 0, cfg.model.vocab_size, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(shapes[-1], dtype=jnp.int32), shapes)
        return {"inputs": tokens[0], "labels": tokens[1], "positions": positions}

    data = batch()
    state = trainer.init(jax.random.key(0))
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        state, metrics = trainer.step(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    del state, data
    return statistics.median(times[1:])


def _step_seconds_apart(config_name: str, overrides: Sequence[str], layout: Layout, devices: int, steps: int
                        ) -> float:
    """`_step_seconds` on forced CPU devices in a process of its own, started as `pjax.train` starts one: its
    buffers on huge pages (`pjax.malloc`) and, for a pipeline, its thread pools sized for one
    (`mesh.distributed.pipeline_cpu_threads`), which a process cannot change once JAX has started."""
    from mesh.errors import ConfigError
    from pjax.malloc import huge_pages_env

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.update(huge_pages_env(env))
    cmd = [sys.executable, "-m", "pjax.plan.pipeline_cost", "--devices", str(devices), "--steps", str(steps),
           "--layout", layout.name, config_name, *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise ConfigError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
    return float(proc.stdout.split()[-1])


def pair(devices: int) -> tuple[Layout, Layout]:
    """(the flat step, the pipeline) the section times on `devices`: dp n at two micro-batches, and dp n/2 x
    pp 2 at four, so that every product has the same rows and every device the same FLOPs."""
    from pjax.plan.layouts import Layout

    return (Layout(dp=devices, grad_accum=_MICRO_BATCHES),
            Layout(dp=devices // 2, pp=2, grad_accum=2 * _MICRO_BATCHES))


def measure_pipeline(config_name: str, overrides: Sequence[str] = (), steps: int = 3, rounds: int = 3
                     ) -> dict[str, Any]:
    """The record of the `pipeline` calibration section: both steps' seconds (`pair`), the pipeline's table
    ratio of span to busy time and `extra`, its step's time over the flat one's, less one; an `error` where this
    machine has fewer than 2 devices or an odd number, or the layouts cannot split the config. The two steps
    are timed in `rounds` pairs, one run of each after the other (the median of `steps` steps), and the median
    pair counts: the extra time is a small difference of two steps, and one slow run on a shared host moves
    it by as much as it measures."""
    from mesh.errors import ConfigError
    from pjax.config_io import load_config
    from pjax.plan.estimate import pipeline_ratio, weight_share
    from pjax.plan.layouts import check

    devices = jax.devices()
    n = len(devices)
    fixed: dict[str, Any] = {"config": config_name, "overrides": list(overrides), "devices": n}
    if n < 2 or n % 2:
        return {**fixed, "error": f"a pipeline of 2 stages needs an even number of devices, not {n}"}
    flat, piped = pair(n)
    # forced CPU devices: each step as pjax.train would run it; an accelerator's memory is this process's
    apart = devices[0].platform == "cpu"
    step = (lambda layout: _step_seconds_apart(config_name, overrides, layout, n, steps)) if apart else (
        lambda layout: _step_seconds(config_name, overrides, layout, devices, steps))
    try:
        cfg = load_config(config_name, overrides)
        for layout in (flat, piped):  # what pjax.train would refuse, said before any process starts
            check(cfg, layout)
        runs = [(step(flat), step(piped)) for _ in range(rounds)]
    except ConfigError as e:  # e.g. a batch that dp x micro-batches does not divide: said, not raised
        return {**fixed, "error": f"{piped.name} against {flat.name}: {e}"}
    ratio = pipeline_ratio(piped, weight_share(cfg.model, cfg.train.seq_len))
    extras = sorted((piped_s / flat_s - 1.0, flat_s, piped_s) for flat_s, piped_s in runs)
    extra, flat_s, piped_s = extras[len(extras) // 2]
    return {**fixed, "flat": flat.name, "pipeline": piped.name, "flat_s": flat_s, "pipeline_s": piped_s,
            "table_ratio": ratio, "extra": extra, "extra_by_round": [round(e[0], 4) for e in extras]}


def ticks_share(measured: dict[str, Any], shares_host: bool) -> float:
    """What a pipeline's ticks cost beyond its work and the bubble it pays, as a share of that: its measured
    extra time where the host's cores are shared (the bubble free), else what is left of it after the
    table's whole bubble; never below 0 (a faster pipeline is this host's noise, not a gain)."""
    paid = 1.0 if shares_host else measured["table_ratio"]
    return max(0.0, measured["pipeline_s"] / (measured["flat_s"] * paid) - 1.0)


def pipeline_factor(layout: Layout, profile: Profile, ratio: float) -> tuple[float, str]:
    """(the layout's pipelined step over its work, why), `ratio` being its table's span over busy time. Without
    a calibration's pipeline measurement, the whole bubble. With one, its ticks' share (`ticks_share`) on top
    of the bubble the machine pays: the whole bubble on devices of their own, and for a lockstep table (cp >
    1), whose idle stages run the tick's op on a discard slot, so there the bubble is work; none on devices
    that share a host's cores (which assumes that the busy stages' devices outnumber the cores, as this host's
    8 devices on 2 cores do)."""
    if layout.pp == 1:
        return 1.0, "no pipeline"
    if profile.curves is None:
        return ratio, "the whole bubble"
    measured = profile.curves.pipeline
    if measured is None:
        return ratio, "the whole bubble (the calibration measured no pipeline: calibrate with --config)"
    ticks = ticks_share(measured, profile.shares_host)
    source = f"{measured['pipeline']} against {measured['flat']} of {measured['config']}"
    if profile.shares_host and layout.cp == 1:
        return 1.0 + ticks, f"bubble free (shared cores) x {1 + ticks:.3f}, the ticks' share measured by {source}"
    why = "lockstep: idle stages compute" if layout.cp > 1 else "the whole bubble"
    return ratio * (1.0 + ticks), f"x {ratio:.3f} ({why}) x {1 + ticks:.3f}, the ticks' share measured by {source}"


def main() -> None:
    """`_step_seconds_apart`'s process: one layout's median step seconds on `--devices` forced CPU devices."""
    ap = argparse.ArgumentParser(description="one layout's step seconds (the calibration's pipeline section)")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", required=True)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from mesh.distributed import pipeline_cpu_threads
    from mesh.errors import ConfigError
    from pjax.plan.layouts import Layout

    layout = Layout.parse(args.layout)
    pipeline_cpu_threads(layout.mesh, args.devices)
    jax.config.update("jax_num_cpu_devices", args.devices)
    try:
        print(_step_seconds(args.config, args.overrides, layout, jax.devices(), args.steps))
    except ConfigError as e:
        sys.exit(str(e))


if __name__ == "__main__":
    main()
