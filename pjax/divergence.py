"""The divergence guard: a non-finite step is caught one step late at no extra cost, and never saved.

On the device, inside the jitted step: `finite = isfinite(loss) & isfinite(grad_norm)`, a scalar
returned with the metrics. Under `train.on_nonfinite=skip` the step also keeps the old parameters
and optimizer state where `finite` is false (`keep_if_finite`, a select per leaf), so the
optimizer's own step count does not advance either and the learning-rate schedule resumes where
it was (`optim.schedule_count`). Under `stop` there is no select (it costs temporaries, see
benchmarks/README.md): the run ends at that step, before anything saves or reads its state.

On the host (`DivergenceGuard`, in the training loop): each step's loss and `finite` flag are
read one step late, when the loop waits for the previous step anyway (it keeps at most two in
flight), so there is no extra synchronisation; a checkpoint save (and a logged step) reads its
own step's flag first, so no checkpoint is written after a step not known to be finite. Then:

* `train.on_nonfinite=stop` (the default): the run ends with one line naming the step and the
  last good checkpoint (`Diverged`, exit status 2).
* `train.on_nonfinite=skip`: the step is dropped (state unchanged) and counted in metrics.jsonl;
  `train.max_skipped` skips in a row end the run as `stop` does.
* Loss spikes: a finite loss more than `log.spike_sigma` standard deviations above the mean of
  the last `SPIKE_WINDOW` steps is written to metrics.jsonl (`loss_spike`: how many deviations)
  and reported in one warning line. It is a report, not an intervention.
"""
from __future__ import annotations

import collections
import math
from typing import Any

import jax
import jax.numpy as jnp

from mesh.errors import ConfigError

SPIKE_WINDOW = 50  # recent losses the spike test compares against
SPIKE_MIN_HISTORY = 10  # no spike test before this many finite losses


class Diverged(ConfigError):
    """The run stopped on a non-finite loss or gradient (one line: the step and where to resume)."""


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `finite` (a scalar bool), else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


class DivergenceGuard:
    """Applies train.on_nonfinite to each step's (loss, finite) and watches the loss for spikes."""

    def __init__(self, policy: str, max_skipped: int, spike_sigma: float) -> None:
        self.policy, self.max_skipped, self.spike_sigma = policy, max_skipped, spike_sigma
        self.skipped = 0  # skipped steps in all
        self.in_a_row = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, loss: float, grad_norm: float, finite: bool,
                last_checkpoint: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """Check one step. Returns (a record for metrics.jsonl, a warning line), either may be None;
        raises `Diverged` when the run must stop."""
        if not finite:
            self.skipped += 1
            self.in_a_row += 1
            what = f"step {step}: the loss is {loss} and the gradient norm {grad_norm}"
            if self.policy == "stop" or self.in_a_row >= self.max_skipped:
                why = ("train.on_nonfinite=stop" if self.policy == "stop"
                       else f"{self.in_a_row} non-finite steps in a row, train.max_skipped={self.max_skipped}")
                resume = (f"The last good checkpoint is {last_checkpoint}; resume from it" if last_checkpoint
                          else "No checkpoint was written (set checkpoint.dir to keep them); start again")
                other = ", or set train.on_nonfinite=skip" if self.policy == "stop" else ""
                raise Diverged(f"{what}, not finite; stopped ({why}). {resume} with a lower train.lr{other}.")
            record = {"step": step, "loss": loss, "grad_norm": grad_norm, "skipped_step": True,
                      "skipped_steps": self.skipped}
            return record, (f"warning: {what}, not finite; skipped it (parameters and optimizer state unchanged, "
                            f"{self.in_a_row} in a row of train.max_skipped={self.max_skipped}).")
        self.in_a_row = 0
        spike = self._spike(loss)
        self._recent.append(loss)
        if spike is None:
            return None, None
        return ({"step": step, "loss": loss, "loss_spike": spike},
                f"warning: step {step}: loss spike, {loss:.4f} is {spike:.1f} standard deviations above the mean "
                f"of the last {len(self._recent) - 1} steps.")

    def _spike(self, loss: float) -> float | None:
        """How many standard deviations `loss` lies above the recent mean, when more than spike_sigma."""
        if not self.spike_sigma or len(self._recent) < SPIKE_MIN_HISTORY:
            return None
        mean = math.fsum(self._recent) / len(self._recent)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self._recent) / len(self._recent))
        # A floor on the deviation: a flat loss (std ~ 0) must not turn float noise into spikes.
        z = (loss - mean) / max(std, 1e-3 * abs(mean), 1e-12)
        return z if z > self.spike_sigma else None
