"""Two training steps of the model at hand timed against each other on the machine at hand: what the
calibration's `pipeline` and `stream` sections measure (`pipeline_cost`, `stream_cost`).

A difference of two steps is small next to either, and on a shared host one slow run moves it by as much as it
measures: so the two are timed in rounds, one run of each after the other, and the median round counts. On
forced CPU devices each layout's step runs in a process of its own, started as `pjax.train` starts one (its
buffers on huge pages; a pipeline's thread pools are sized at start-up, which a process cannot change once JAX
runs), built once and timed on request; an accelerator's steps run in this process."""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from pjax.plan.layouts import Layout


def stepper(config_name: str, overrides: Sequence[str], layout: Layout, devices: list) -> Callable[[int], float]:
    """`layout`'s training step built on `devices` with a batch: a call starts a state, times `steps` steps after
    one warm-up step (the first call's compiles) and drops the state, so that two steppers of a model that
    fills the devices can take turns; it gives the steps' median seconds."""
    from pjax.config_io import load_config
    from pjax.step import mesh_for, trainer_for

    cfg = load_config(config_name, [*overrides, *layout.overrides()])
    trainer = trainer_for(mesh_for(cfg, devices), cfg)
    shapes = trainer.abstract_batch()["inputs"].shape

    @functools.partial(jax.jit, out_shardings=trainer.batch_sharding)
    def batch() -> dict:
        tokens = jax.random.randint(jax.random.key(0), (2, *shapes), 0, cfg.model.vocab_size, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(shapes[-1], dtype=jnp.int32), shapes)
        return {"inputs": tokens[0], "labels": tokens[1], "positions": positions}

    data = batch()

    def run(steps: int) -> float:
        state, times = trainer.init(jax.random.key(0)), []
        for _ in range(steps + 1):
            t = time.perf_counter()
            state, metrics = trainer.step(state, data)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])
    return run


def _serve(config_name: str, overrides: Sequence[str], layout: Layout, devices: int, steps: int) -> subprocess.Popen:
    """A process of its own for `layout` on forced CPU devices, started as `pjax.train` starts one: its buffers on
    huge pages (`pjax.malloc`) and, for a pipeline, its thread pools sized for one
    (`mesh.distributed.pipeline_cpu_threads`). It builds the step, then times `steps` steps for each line it
    reads and answers with their median seconds; between runs it waits, leaving the cores to its partner."""
    from pjax.malloc import huge_pages_env

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.update(huge_pages_env(env))
    cmd = [sys.executable, "-m", "pjax.plan.step_pairs", "--devices", str(devices), "--steps", str(steps),
           "--layout", layout.name, config_name, *overrides]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _ask(proc: subprocess.Popen) -> float:
    """One run of a `_serve` process: its median step seconds, or its last line of error as a ConfigError."""
    from mesh.errors import ConfigError

    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
    except BrokenPipeError:  # it has exited: its stderr says why
        pass
    line = proc.stdout.readline()
    if not line:
        err = proc.communicate()[1].strip().splitlines()
        raise ConfigError(err[-1] if err else f"exit status {proc.returncode}")
    return float(line)


def timed_pair(config_name: str, overrides: Sequence[str], first: Layout, second: Layout, steps: int, rounds: int
               ) -> tuple[float, float, list[float]]:
    """(first's seconds, second's, every round's second / first - 1, sorted) of the median round, each run the
    median of `steps` steps after a warm-up, one run of each after the other per round. On forced CPU devices
    each layout has a process of its own for the whole measurement (`_serve`). ConfigError where the config
    cannot take either layout, said before any run."""
    from pjax.config_io import load_config
    from pjax.plan.layouts import check

    devices = jax.devices()
    cfg = load_config(config_name, overrides)
    for layout in (first, second):  # what pjax.train would refuse, said before any process starts
        check(cfg, layout)
    if devices[0].platform != "cpu":
        runs = [stepper(config_name, overrides, layout, devices) for layout in (first, second)]
        times = [[run(steps) for run in runs] for _ in range(rounds)]
    else:
        procs = [_serve(config_name, overrides, layout, len(devices), steps) for layout in (first, second)]
        try:
            times = [[_ask(proc) for proc in procs] for _ in range(rounds)]
        finally:
            for proc in procs:
                proc.kill()
                proc.communicate()
    ordered = sorted((b / a - 1.0, a, b) for a, b in times)
    _, a, b = ordered[len(ordered) // 2]
    return a, b, [round(r[0], 4) for r in ordered]


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = argparse.ArgumentParser(prog="python -m pjax.plan.step_pairs", description="a layout's median step seconds on forced CPU devices, per line of stdin")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", required=True, help="a planner layout name, e.g. dp2-tp4-sp-m2")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    return ap


def main() -> None:
    """`_serve`'s process: one layout's step on `--devices` forced CPU devices, timed once per line of stdin."""
    from pjax.platforms import missing_gpu, start_platforms

    start_platforms()  # run by hand too: no CUDA plugin traceback where it finds no GPU
    if missing_gpu():
        sys.exit(f"error: {missing_gpu()}")
    args = parser().parse_args()
    from mesh.distributed import pipeline_cpu_threads
    from mesh.errors import ConfigError
    from pjax.plan.layouts import Layout

    layout = Layout.parse(args.layout)
    pipeline_cpu_threads(layout.mesh, args.devices)
    jax.config.update("jax_num_cpu_devices", args.devices)
    try:
        run = stepper(args.config, args.overrides, layout, jax.devices())
    except ConfigError as e:
        sys.exit(str(e))
    for _ in sys.stdin:
        print(run(args.steps), flush=True)


if __name__ == "__main__":
    main()
