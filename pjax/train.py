"""`python -m pjax.train [--config NAME|FILE] [section.key=value ...]`: the whole training loop.

With no arguments it trains the shipped debug config's tiny LLaMA on the shipped Pride and Prejudice
text, on forced CPU devices when no accelerator is present."""
from __future__ import annotations

if __name__ == "__main__":  # first, before JAX loads: glibc reads its tunables only at process start
    from pjax.malloc import restart_with_huge_pages
    from pjax.platforms import start_platforms

    start_platforms()  # JAX_PLATFORMS=cpu where JAX's CUDA plugin has no GPU: XLA:CPU's buffers on huge pages too
    restart_with_huge_pages()

import argparse
import dataclasses
import re
import sys
from typing import Any, Callable, NamedTuple, Sequence

from mesh import watchdog
from mesh.distributed import force_cpu_devices, init_distributed, pipeline_cpu_threads
from mesh.errors import ConfigError
from mesh.mesh import MeshConfig
from pjax.cli import ArgumentParser, run_main, writable_dir
from pjax.config import Config
from pjax.config_io import load_config, named_keys
from pjax.observe.progress import StopFlag


def parser() -> ArgumentParser:
    """The command line's parser (tests/test_docs.py parses the commands the docs show with it)."""
    ap = ArgumentParser(prog="python -m pjax.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a shipped config name (pjax/assets/configs/) or a YAML path (default: debug)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. mesh.tp=2 train.steps=50")
    ap.add_argument("--coordinator", default=None, help="multi-host: coordinator address host:port")
    ap.add_argument("--num_processes", type=int, default=None, help="multi-host: number of processes")
    ap.add_argument("--process_id", type=int, default=None, help="multi-host: this process's index")
    ap.add_argument("--join_timeout", type=float, default=300,
                    help="multi-host: seconds for every process to join before this one gives up (default 300)")
    ap.add_argument("--peer_timeout", type=float, default=30,
                    help="multi-host: seconds a process may stay silent before the others stop (default 30)")
    ap.add_argument("--no_progress", action="store_true", help="log lines instead of a progress bar")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return parser().parse_intermixed_args(argv)  # options may come after the overrides too


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    from pjax.fit import adopt_hf_model, names_a_mesh

    cfg = load_config(args.config, args.overrides)
    named = named_keys(args.config, args.overrides)
    if cfg.train.init_from is not None:  # the model and its tokenizer are the checkpoint's: a config file's only
        cfg = adopt_hf_model(cfg, named_keys(None, args.overrides))  # state defaults, a command line's must agree
    fit = cfg.train.init_from is not None and not names_a_mesh(named)  # nor is the default mesh the user's
    num_processes = init_distributed(args.coordinator, args.num_processes, args.process_id, args.join_timeout,
                                     args.peer_timeout)
    with watchdog.guarding():  # from here a lost process ends this one in one line (mesh/watchdog.py)
        _train_joined(cfg, fit, num_processes, progress=not args.no_progress)


def _train_joined(cfg: Config, fit: bool, num_processes: int, progress: bool) -> None:
    """`train` once this process has joined the run: its devices forced, an HF model's mesh fitted, and the
    allocator's own failure (past check_fits' estimate) in one line."""
    from jax.errors import JaxRuntimeError  # importing JAX starts no backend

    from pjax.fit import describe, fitted_mesh

    local = force_cpu_devices(MeshConfig() if fit else cfg.mesh, num_processes)
    pipeline_cpu_threads(cfg.mesh, local)
    devices = None
    if fit:
        import jax

        cfg = dataclasses.replace(cfg, mesh=fitted_mesh(cfg.model))
        devices = jax.devices()[:cfg.mesh.size]  # an MoE model's fitted mesh may leave devices idle
        if jax.process_index() == 0:
            print(describe(cfg.mesh, cfg.model))
    try:
        train(cfg, progress=progress, devices=devices)
    except JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        import jax

        from pjax.observe.memory import memory_fixes

        raise ConfigError(f"a device ran out of memory ({_allocation(e)}): {memory_fixes(jax.default_backend())}; "
                          f"checkpoints are intact.") from None


def _allocation(error: Exception) -> str:
    """The allocation a device could not make, from XLA's RESOURCE_EXHAUSTED message, in a few words."""
    line = (str(error).splitlines() or [""])[0]
    allocating = re.search(r"allocate (\S+(?: bytes)?)", line)
    if allocating:
        return f"allocating {allocating.group(1).rstrip('.,;')}"
    line = line.removeprefix("RESOURCE_EXHAUSTED: ")
    return line if len(line) <= 40 else line[:40] + "…"


def train(cfg: Config, progress: bool = True, devices: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Train `cfg.train.steps` steps; returns metrics.jsonl's records (`devices`: all, or a subset in tests)."""
    from pjax.observe.profiling import check_profile_steps
    from pjax.checkpoint.resume import open_run
    from pjax.data.curriculum import Curriculum

    check_profile_steps(cfg.log.profile_steps, cfg.train.steps)
    Curriculum.of(cfg.data.curriculum, cfg.train.seq_len)  # a malformed one fails before any work
    for key, path in (("log.dir", cfg.log.dir), ("data.cache_dir", str(cfg.data.cache_path)),
                      ("checkpoint.dir", cfg.checkpoint.dir)):
        if path is not None:  # before any work: a path that cannot be written loses nothing
            writable_dir(path, key)
    ckpt, cfg, note = open_run(cfg)
    try:
        return _loop(cfg, ckpt, _prepare(cfg, ckpt, devices, note), progress)
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the save in flight: a stopped run exits with its last checkpoint complete


class _Run(NamedTuple):
    """What the loop needs, built and checked before the first step."""

    trainer: Any
    data: Any  # a Prefetcher at the run's position
    state: Any
    rng: Any
    memory_estimate: tuple[int, int]  # the compiled step's resident and peak bytes per device
    steps: dict[int, Any]  # with data.curriculum: the step compiled ahead per sequence length


def _prepare(cfg: Config, ckpt: Any, devices: Sequence[Any] | None, note: str | None) -> _Run:
    """Mesh, sharded step, data and state, each failing with one line before any step runs."""
    import jax

    from mesh.mesh import CP
    from pjax.checkpoint.resume import write_config
    from pjax.data import build_data
    from pjax.data.curriculum import Curriculum
    from pjax.data.prefetch import Prefetcher
    from pjax.observe.memory import step_memory_bytes
    from pjax.parallel.context.zigzag import zigzag_layout
    from pjax.step import init_state, mesh_for, trainer_for
    from pjax.validate import Run

    tc, mc = cfg.train, cfg.model
    _warn_if_longer_than_the_model(cfg)
    mesh = mesh_for(cfg, devices)
    build = lambda train: trainer_for(mesh, cfg, train)
    trainer = build(tc)
    _warn_if_zero_has_whole_groups(tc, mesh)
    curriculum = Curriculum.for_run(cfg.data.curriculum,
                                    Run(MeshConfig.of(mesh), mc, tc, cfg.pipeline, cfg.context, cfg.precision))
    train_iter, _, tokenizer = build_data(cfg.data, tc, mesh, cfg.meta.tasks, cfg.meta.task_field,
                                          sequence_layout=zigzag_layout(mesh.shape[CP]), curriculum=curriculum)
    if tokenizer.get_vocab_size() > mc.vocab_size:
        raise ConfigError(f"the tokenizer {cfg.data.tokenizer} has {tokenizer.get_vocab_size()} tokens but "
                          f"model.vocab_size={mc.vocab_size}; raise model.vocab_size or use a smaller tokenizer.")
    if cfg.log.eval_every:
        train_iter.num_eval_batches(cfg.log.eval_batches)  # a held-out split too small for one batch fails now
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    trainer, steps = _compile_steps(trainer, build, curriculum, say)
    compiled = steps[tc.seq_len]
    if ckpt is not None and ckpt.latest_step() is not None:
        restored = ckpt.restore(trainer, cfg)
        state, rng = restored.state, restored.rng
        train_iter.restore(restored.data)
        ckpt.set_aside_unreadable(after=int(state.step))
        say(f"resumed from {ckpt.directory} at step {int(state.step)}")
        if note:
            say(note)
    else:
        state = init_state(trainer, jax.random.key(tc.seed), init_from=tc.init_from)
        # A training key, kept apart from init's and saved with checkpoints; no step draws from it yet.
        rng = jax.random.fold_in(jax.random.key(tc.seed), 1)
    for directory in (cfg.log.dir, cfg.checkpoint.dir):
        if directory is not None:
            write_config(cfg, directory)
    _report_start(cfg, trainer, state, compiled, curriculum, say)
    memory = (compiled.memory_analysis().argument_size_in_bytes, step_memory_bytes(compiled))
    return _Run(trainer, Prefetcher(train_iter, cfg.data.prefetch), state, rng, memory,
                steps if curriculum is not None else {})


def _report_start(cfg: Config, trainer: Any, state: Any, compiled: Any, curriculum: Any,
                  say: Callable[..., None]) -> None:
    """What a run says before its first step: the mesh, pjax's XLA options (GPUs), the parameters' shardings, the
    memory and collectives report (`log.inspect`), the model's size and the tokens per step."""
    from mesh.hosts import across_hosts_line
    from mesh.mesh import mesh_summary
    from models import llama
    from pjax import xla_options
    from pjax.observe.report import local_devices
    from pjax.plan.inspect import parameter_table, step_report
    from pjax.platforms import fallback_note

    tc, mc, mesh = cfg.train, cfg.model, trainer.mesh
    crossing = across_hosts_line(mesh)
    say(mesh_summary(mesh) + (f"; {crossing}" if crossing else "") + fallback_note())
    if xla_options.describe(trainer.xla_options):
        say(xla_options.describe(trainer.xla_options))
    say(parameter_table(state.params, llama.param_logical_axes(mc)))
    if cfg.log.inspect:
        say(step_report(cfg, mesh, compiled, devices_per_host=len(local_devices(mesh))))
    say(f"parameters: {mc.num_params:,} ({mc.num_params / 1e6:.1f}M); tokens per step: "
        f"{tc.batch_size * tc.seq_len:,} ({tc.batch_size} x {tc.seq_len}, {tc.grad_accum} micro-batches)"
        + (f"; curriculum: {curriculum.describe()}" if curriculum is not None else ""))


def _warn_if_longer_than_the_model(cfg: Config) -> None:
    """Only a warning: RoPE computes any position, but the saved model claims the shorter context."""
    import jax

    tc, mc = cfg.train, cfg.model
    if tc.seq_len > mc.max_position_embeddings and jax.process_index() == 0:
        print(f"warning: train.seq_len={tc.seq_len} is longer than model.max_position_embeddings="
              f"{mc.max_position_embeddings}; raise that to at least {tc.seq_len}, or the saved and exported model "
              f"declares the shorter context.", file=sys.stderr, flush=True)


def _warn_if_zero_has_whole_groups(tc: Any, mesh: Any) -> None:
    """Only a warning: ZeRO under DiLoCo in groups of one replica shards the global state, not the groups'."""
    import jax

    from pjax.parallel.group_zero import whole_groups_note

    note = whole_groups_note(tc, mesh.shape["dp"])
    if note and jax.process_index() == 0:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def _compile_steps(trainer: Any, build: Callable[[Any], Any], curriculum: Any, say: Callable[..., None]
                   ) -> tuple[Any, dict[int, Any]]:
    """The step compiled from shapes before any allocation, per sequence length the run trains on (the longest
    first): a step that cannot fit fails here, and none pauses to compile. jit reuses these compilations. The
    trainer comes back rebuilt with chunked attention where cuDNN's does not compile (`pjax.cudnn_fallback`)."""
    from pjax.cudnn_fallback import compile_step
    from pjax.observe.memory import check_fits

    lengths = (trainer.tc.seq_len,) if curriculum is None else curriculum.lengths
    steps = {}
    for length in reversed(lengths):
        trainer, steps[length], warning = compile_step(trainer, build, length)
        if warning:
            say(warning, file=sys.stderr, flush=True)
        check_fits(steps[length], trainer.mesh)
    return trainer, steps


def _loop(cfg: Config, ckpt: Any, run: _Run, progress: bool) -> list[dict[str, Any]]:
    """Steps from the run's position to train.steps: logging, evaluation, saves, the guard, SIGTERM."""
    import jax

    from pjax.observe.profiling import StepProfiler
    from pjax.observe.report import RunReport

    tc, trainer, train_iter, state = cfg.train, run.trainer, run.data, run.state
    start = int(state.step)
    report = RunReport(cfg, ckpt, trainer, train_iter, run.memory_estimate, progress, start)
    profiler = StepProfiler(cfg.log.profile_steps, cfg.log.dir, start + 1, report.bar.note, report.bar.warn)
    stop, pending = StopFlag(), None
    try:
        for step in range(start + 1, tc.steps + 1):
            profiler.start_if_due(step, state)
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                batch = next(train_iter)
                length = batch["inputs"].shape[-1]
                state, metrics = run.steps.get(length, trainer.step)(state, batch)
            profiler.stop_if_due(step, (state, metrics))
            # Reading the previous step's flags now costs no wait and keeps at most two steps in flight
            # (an unbounded queue of dispatched steps can deadlock XLA:CPU's collectives on few cores).
            if pending is not None:
                report.check(*pending)
            pending = (step, metrics)
            report.took(length)
            last = step == tc.steps
            log_now = step % cfg.log.every == 0 or last
            eval_now = cfg.log.eval_every and (step % cfg.log.eval_every == 0 or last)
            save_now = ckpt is not None and (ckpt.due(step) or last or stop.requested)
            if not (log_now or eval_now or save_now):
                continue
            host, pending = report.check(step, metrics), None  # this step's own flag before anything uses it
            if log_now:
                report.log(step, host)
            if eval_now:
                report.evaluate(step, state)
            # `stop.requested` again: a signal that came while this step was logged or evaluated still saves it.
            if ckpt is not None and (save_now or stop.requested):
                ckpt.save(step, state, data=train_iter.state(), rng=run.rng, config=cfg)
            if stop.requested:
                report.bar.note(f"stopping at step {step} on {stop.requested}")
                break
    finally:
        train_iter.close()
        profiler.close()
        report.close()
        stop.restore()
    return report.records


if __name__ == "__main__":
    sys.exit(main())
