"""`log.profile_steps=[start, count]`: a `jax.profiler` trace of `count` training steps from step `start`.

With two steps in flight, the trace waits for the step before `start` and for its last step, so it holds
only those steps' device work; the waits change when the host dispatches, never what a step computes."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mesh.errors import ConfigError


def check_profile_steps(profile_steps: tuple[int, int] | None, train_steps: int) -> None:
    """A ConfigError for a trace past the run's last step."""
    if profile_steps is None:
        return
    start, count = profile_steps
    if start + count - 1 > train_steps:
        raise ConfigError(f"log.profile_steps=[{start}, {count}] traces steps {start} to {start + count - 1}, past "
                          f"train.steps={train_steps}; choose [start, count] with start + count - 1 <= {train_steps}.")


class StepProfiler:
    """Starts and stops one trace around the configured steps of this run (none when off)."""

    def __init__(self, profile_steps: tuple[int, int] | None, log_dir: str, first_step: int,
                 note: Callable[[str], None], warn: Callable[[str], None]) -> None:
        import jax

        self._note, self._active = note, False
        self._first = self._last = self._dispatched = None
        if profile_steps is None:
            return
        start, count = profile_steps
        last = start + count - 1
        self._directory = Path(log_dir, "profile")
        if jax.process_count() > 1:  # processes on one host must not collide
            self._directory = self._directory / f"process{jax.process_index()}"
        if start < first_step:  # a resumed run: the steps before it ran in an earlier process
            done = min(last, first_step - 1)
            ran = f"step {start}" if done == start else f"steps {start} to {done}"
            rest = "tracing none" if last < first_step else f"tracing steps {first_step} to {last}"
            warn(f"warning: log.profile_steps=[{start}, {count}]: {ran} ran before this run resumed at step "
                 f"{first_step}; {rest}.")
        if last >= first_step:
            self._first, self._last = max(start, first_step), last

    def start_if_due(self, step: int, previous: Any) -> None:
        """Before dispatching `step`: at the first traced step, wait for `previous`, then start the trace."""
        import jax

        if step != self._first:
            return
        jax.block_until_ready(previous)
        jax.profiler.start_trace(str(self._directory), create_perfetto_trace=True)
        self._active = True

    def stop_if_due(self, step: int, outputs: Any) -> None:
        """After dispatching `step`: at the last traced step, wait for its `outputs`, then write the trace."""
        import jax

        if not self._active:
            return
        self._dispatched = step
        if step == self._last:
            jax.block_until_ready(outputs)
            self._stop()

    def close(self) -> None:
        """A run that stops inside the traced steps (a signal, an error) still writes what it traced."""
        if self._active:
            self._stop()

    def _stop(self) -> None:
        import jax

        self._active = False
        jax.profiler.stop_trace()
        written = max(self._directory.glob("plugins/profile/*"), key=lambda p: p.stat().st_mtime)
        last = self._dispatched or self._first  # none: the first traced step failed to dispatch
        steps = f"step {self._first}" if self._first == last else f"steps {self._first} to {last}"
        self._note(f"profile of {steps}: {written} (tensorboard --logdir {self._directory}; or its "
                   f"perfetto_trace.json.gz in ui.perfetto.dev)")
