"""What a pipeline pays on this machine beyond its bubble-free work, measured on the model at hand.

A schedule's table says how long a device idles (the bubble, `estimate.pipeline_ratio`). What the machine
pays for it is another matter: on devices of their own an idle tick costs a whole tick, plus each tick's own
work (the conditionals, the slot writes and reads, the rendezvous of the permutes); on forced CPU devices
that share a host's cores, the stages with work take the idle stages' cores, so the bubble costs little but
the per-tick work stays. Neither is a matmul rate, so this is measured whole: the model's own training step
at pp = 2 (1F1B, two micro-batches, the other devices on dp) against the same step without a pipeline, and
the pipeline's extra time expressed as the share of the table's bubble it amounts to (`paid`). On forced
CPU devices each step runs in a process of its own, started as `pjax.train` starts one (a pipeline's
thread pools are sized at start-up). The planner charges every pipeline's bubble at that share
(`bubble_share`): one number for every schedule and micro-batch count, so the per-tick work of a table with
more ticks than this one is charged as if it scaled with the bubble."""
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

_MICRO_BATCHES = 2  # p = m = 2: the largest bubble a 1F1B table has, so the clearest signal


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


def measure_pipeline(config_name: str, overrides: Sequence[str] = (), steps: int = 3, rounds: int = 3
                     ) -> dict[str, Any]:
    """The record of the `pipeline` calibration section: both steps' seconds, the table's ratio of span to
    busy time, and `paid`, the share of the table's bubble the pipeline's extra time amounts to; an `error`
    where this machine has fewer than 2 devices or an odd number, or the layouts cannot split the config. The
    two steps are timed in `rounds` pairs, one run of each after the other (the median of `steps` steps), and
    the median pair's share counts: a share is a small difference of two steps, and one slow run on a shared
    host moves it by as much as it measures."""
    from mesh.errors import ConfigError
    from pjax.config_io import load_config
    from pjax.plan.estimate import pipeline_ratio, weight_share
    from pjax.plan.layouts import Layout, check

    devices = jax.devices()
    n = len(devices)
    fixed: dict[str, Any] = {"config": config_name, "overrides": list(overrides), "devices": n}
    if n < 2 or n % 2:
        return {**fixed, "error": f"a pipeline of 2 stages needs an even number of devices, not {n}"}
    flat = Layout(dp=n, grad_accum=_MICRO_BATCHES)
    piped = Layout(dp=n // 2, pp=2, grad_accum=_MICRO_BATCHES)
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
    shares = sorted(((piped_s / flat_s - 1.0) / (ratio - 1.0), flat_s, piped_s) for flat_s, piped_s in runs)
    share, flat_s, piped_s = shares[len(shares) // 2]
    return {**fixed, "flat": flat.name, "pipeline": piped.name, "flat_s": flat_s, "pipeline_s": piped_s,
            "table_ratio": ratio, "paid": max(0.0, share), "paid_by_round": [round(s[0], 4) for s in shares]}


def bubble_share(layout: Layout, profile: Profile) -> tuple[float, str]:
    """(the share of the table's bubble a pipeline's step pays, why). With a calibration's pipeline measurement,
    the share its step paid (`pipeline_cost`); a lockstep table (cp > 1) has its idle stages run the tick's op
    on a discard slot, so there the bubble is work: whole, plus the measured share on devices that share a
    host's cores (where the measured share is the ticks' overhead, not idling), at least whole elsewhere.
    Without one, the whole bubble."""
    if profile.curves is None:
        return 1.0, "the whole bubble"
    measured = profile.curves.pipeline
    if measured is None:
        return 1.0, "the whole bubble (the calibration measured no pipeline: calibrate with --config)"
    paid, source = measured["paid"], f"{measured['pipeline']} against {measured['flat']} of {measured['config']}"
    if layout.cp == 1:
        return paid, f"x {paid:.2f}, the share a pipeline paid here ({source})"
    share = paid + 1.0 if profile.shares_host else max(paid, 1.0)
    return share, f"x {share:.2f}: lockstep, idle stages compute; {paid:.2f} paid by {source}"


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
