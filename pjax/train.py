"""`python -m pjax.train [--config NAME|FILE] [section.key=value ...]`: the whole training loop.

Top to bottom: config -> devices and mesh -> data -> sharded state -> compiled step -> loop
(progress bar, metrics.jsonl, TensorBoard, held-out loss). With no arguments it trains the
tiny LLaMA of configs/debug.yaml on the shipped Pride and Prejudice text, on forced CPU devices
when no accelerator is present.
"""
from __future__ import annotations

if __name__ == "__main__":  # first, before JAX loads: glibc reads its tunables only at process start
    from pjax.malloc import restart_with_huge_pages

    restart_with_huge_pages()

import argparse
import math
import signal
import sys
import time
from typing import Any, Sequence

import numpy as np

from mesh.distributed import force_cpu_devices, init_distributed, spare_cpu_thread
from mesh.errors import ConfigError
from pjax.config import Config
from pjax.config_io import load_config


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pjax.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a config name in configs/ or a YAML path (default: debug)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. mesh.tp=2 train.steps=50")
    ap.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
    ap.add_argument("--num_processes", type=int, default=None, help="multi-host: number of processes")
    ap.add_argument("--process_id", type=int, default=None, help="multi-host: this process's index")
    ap.add_argument("--no_progress", action="store_true", help="log lines instead of a progress bar")
    return ap.parse_intermixed_args(argv)  # options may come after the overrides too


def main(argv: Sequence[str] | None = None) -> int:
    from jax.errors import JaxRuntimeError  # importing JAX starts no backend

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        num_processes = init_distributed(args.coordinator, args.num_processes, args.process_id)
        force_cpu_devices(cfg.mesh, num_processes)
        spare_cpu_thread(cfg.mesh)
        train(cfg, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except JaxRuntimeError as e:  # the allocator's own failure, past check_fits' estimate
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        import jax

        from pjax.step import preallocation_hint

        print(f"error: a device ran out of memory ({str(e).splitlines()[0][:160]}); lower the rows per device "
              f"(train.batch_size, or raise train.grad_accum), set train.remat=full, or split the state further "
              f"(train.zero, mesh.tp, mesh.pp). Checkpoints already written are intact."
              f"{preallocation_hint(jax.default_backend())}", file=sys.stderr)
        return 2
    return 0


def train(cfg: Config, progress: bool = True, devices: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Train for `cfg.train.steps` steps; returns the logged records (also in metrics.jsonl).

    `devices` defaults to all devices; tests pass a subset to run several layouts in one process.
    """
    import jax

    from mesh.mesh import CP, make_mesh, mesh_summary
    from models import llama
    from pjax.checkpoint import open_for_run, write_config
    from pjax.data import build_data
    from pjax.metrics import MetricsWriter, mfu, model_flops_per_token, peak_flops
    from pjax.parallel.context_parallel import zigzag_layout
    from pjax.step import build_trainer, check_fits, init_state

    tc, mc = cfg.train, cfg.model
    mesh = make_mesh(cfg.mesh, devices)
    trainer = build_trainer(mesh, mc, tc, cfg.pipeline)
    # Context parallelism's load-balanced layout (the identity when cp = 1); positions follow it.
    train_iter, _, tokenizer = build_data(cfg.data, tc, mesh, sequence_layout=zigzag_layout(mesh.shape[CP]))
    if tokenizer.get_vocab_size() > mc.vocab_size:
        raise ConfigError(f"the tokenizer {cfg.data.tokenizer} has {tokenizer.get_vocab_size()} tokens but "
                          f"model.vocab_size={mc.vocab_size}; raise model.vocab_size or use a smaller tokenizer.")
    if cfg.log.eval_every:
        train_iter.num_eval_batches()  # a held-out split too small for one batch fails now, not at the first eval
    # Compiled from shapes before anything is allocated (the step's first call reuses it), so a
    # step that cannot fit in device memory is a one-line error here, not an allocator failure later.
    check_fits(trainer.compile_step(), mesh)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    ckpt = open_for_run(cfg, trainer)  # None without checkpoint.dir
    if ckpt is not None and ckpt.latest_step() is not None:  # resume: state, data position and RNG
        state, data_state, rng, _ = ckpt.restore(trainer, cfg)
        train_iter.restore(data_state)
        say(f"resumed from {ckpt.directory} at step {int(state.step)}")
    else:
        state = init_state(trainer, jax.random.key(tc.seed), init_from=tc.init_from)
        # The training RNG stream, kept apart from init's: step s draws jax.random.fold_in(rng, s).
        rng = jax.random.fold_in(jax.random.key(tc.seed), 1)
    start = int(state.step)
    say(mesh_summary(mesh))
    say(sharding_summary(state.params, llama.param_logical_axes(mc)))
    say(f"parameters: {mc.num_params:,} ({mc.num_params / 1e6:.1f}M); tokens per step: "
        f"{tc.batch_size * tc.seq_len:,} ({tc.batch_size} x {tc.seq_len}, {tc.grad_accum} micro-batches)")

    flops_per_token = model_flops_per_token(mc, tc.seq_len)
    peak = peak_flops(jax.devices()[0], cfg.log.peak_flops)
    tokens_per_step = tc.batch_size * tc.seq_len
    writer = MetricsWriter(cfg.log.dir, append=start > 0)  # a resumed run continues its metrics.jsonl
    write_config(cfg, cfg.log.dir)  # the run directory records exactly what ran
    records: list[dict[str, Any]] = []
    stop = _StopFlag()
    bar = _progress_bar(tc.steps, mode=("bar" if progress else "lines") if jax.process_index() == 0 else "off",
                        initial=start)
    t_last, steps_since, in_flight = time.perf_counter(), 0, None
    try:
        for step in range(start + 1, tc.steps + 1):
            state, metrics = trainer.step(state, next(train_iter))
            # Keep at most two steps in flight: the host prepares the next batch while the devices
            # run this one, but an unbounded queue of dispatched steps can deadlock XLA:CPU's
            # in-process collectives on few cores (seen with log.every=100 on 2 cores).
            if in_flight is not None:
                in_flight.block_until_ready()
            in_flight = metrics["loss"]
            steps_since += 1
            if step % cfg.log.every == 0 or step == tc.steps:
                metrics = jax.device_get(metrics)  # the one host sync per logged step
                elapsed = time.perf_counter() - t_last
                step_time = elapsed / steps_since
                tps = tokens_per_step / step_time
                record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                          "lr": float(metrics["lr"]), "tokens_per_sec": tps,
                          "mfu": mfu(tps, flops_per_token, mesh.devices.size, peak), "step_time_s": step_time}
                if step - start == steps_since:
                    record["includes_compile"] = True  # the first interval's time includes compilation
                writer.write(record)
                records.append(record)
                bar.update(steps_since, record)
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"loss became {record['loss']} at step {step}; lower train.lr.")
                t_last, steps_since, in_flight = time.perf_counter(), 0, None
            if cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step == tc.steps):
                t_eval = time.perf_counter()
                eval_loss = evaluate_held_out(trainer, state, train_iter, cfg.log.eval_batches)
                record = {"step": step, "eval_loss": eval_loss}
                writer.write(record)
                records.append(record)
                bar.note(f"step {step}: held-out loss {eval_loss:.4f}")
                t_last += time.perf_counter() - t_eval  # keep evaluation out of the training throughput
            if ckpt is not None and (ckpt.due(step) or step == tc.steps or stop.requested):
                # Async: the arrays are copied to host memory and written while the next steps run.
                ckpt.save(step, state, data=train_iter.state(), rng=rng, config=cfg)
            if stop.requested:
                bar.note(f"stopping at step {step} on {stop.requested}")
                break
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the save in flight: a stopped run exits with its last checkpoint complete
        bar.close()
        writer.close()
        stop.restore()
    say(f"metrics: {writer.path}")
    return records


def evaluate_held_out(trainer, state, train_iter, num_batches: int) -> float:
    """Mean token loss over up to `num_batches` held-out batches (same compiled loss as training)."""
    losses = [float(trainer.loss(state.params, batch)) for batch in train_iter.eval_batches(num_batches)]
    return float(np.mean(losses))


def sharding_summary(params: Any, logical_axes: Any) -> str:
    """A table: parameter, shape, logical axes, and the mesh axes it is split over."""
    import jax

    rows = [("parameter", "shape", "logical axes", "sharding")]
    flat_axes = dict(jax.tree_util.tree_leaves_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple)))
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(k.key) for k in path)
        rows.append((name, "x".join(map(str, p.shape)), ",".join(flat_axes[path]), str(tuple(p.sharding.spec))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class _StopFlag:
    """SIGTERM/SIGINT finish the current step and leave the loop cleanly (metrics flushed)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class _progress_bar:
    """tqdm with loss, tokens/s and MFU in the postfix ('bar'), plain log lines ('lines'), or nothing
    ('off': processes other than 0)."""

    def __init__(self, total: int, mode: str, initial: int = 0) -> None:
        self._bar, self._quiet = None, mode == "off"
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, n: int, r: dict) -> None:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        fields = {"loss": f"{r['loss']:.4f}", "tok/s": f"{r['tokens_per_sec']:,.0f}", "mfu": mfu}
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(n)
        elif not self._quiet:
            print(f"step {r['step']}: " + " ".join(f"{k} {v}" for k, v in fields.items()), flush=True)

    def note(self, text: str) -> None:
        if not self._quiet:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


if __name__ == "__main__":
    sys.exit(main())
