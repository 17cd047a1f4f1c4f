"""The divergence guard (ARCHITECTURE.md, "A non-finite step is caught without a host sync"): `train.on_nonfinite=stop`
ends the run with one line, `skip` drops the step (up to `train.max_skipped` in a row); loss spikes are only reported."""
from __future__ import annotations

import collections
import math
from typing import Any

import jax
import jax.numpy as jnp

from mesh.errors import ConfigError

SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 10


class Diverged(ConfigError):
    """The run stopped on a non-finite loss or gradient (one line: the step and where to resume)."""


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `finite` (a scalar bool), else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


class DivergenceGuard:
    """Applies train.on_nonfinite to each step's (loss, finite) and watches the loss for spikes."""

    def __init__(self, policy: str, max_skipped: int, spike_sigma: float) -> None:
        self.policy, self.max_skipped, self.spike_sigma = policy, max_skipped, spike_sigma
        self.skipped = 0
        self.in_a_row = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)

    def observe(self, step: int, loss: float, grad_norm: float, finite: bool,
                last_checkpoint: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(a record for metrics.jsonl, a warning line), either may be None; raises `Diverged` to stop."""
        if not finite:
            self.skipped += 1
            self.in_a_row += 1
            what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
            if self.policy == "stop" or self.in_a_row >= self.max_skipped:
                why = ("train.on_nonfinite=stop" if self.policy == "stop"
                       else f"{self.in_a_row} non-finite steps in a row, train.max_skipped={self.max_skipped}")
                resume = (f"resume from {last_checkpoint} with a lower train.lr" if last_checkpoint
                          else "start again with a lower train.lr (no checkpoint was written)")
                other = ", or train.on_nonfinite=skip" if self.policy == "stop" else ""
                raise Diverged(f"{what}, not finite ({why}); {resume}{other}.")
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
        if not self.spike_sigma or len(self._recent) < SPIKE_MIN_HISTORY:
            return None
        mean = math.fsum(self._recent) / len(self._recent)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self._recent) / len(self._recent))
        # A floor on the deviation: a flat loss (std ~ 0) must not turn float noise into spikes.
        z = (loss - mean) / max(std, 1e-3 * abs(mean), 1e-12)
        return z if z > self.spike_sigma else None
