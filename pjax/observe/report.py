"""What a run reports as it trains: flags to the divergence guard, metrics records, held-out losses, the bar."""
from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np

from mesh.mesh import data_size
from models.moe import ROUTER_METRICS
from pjax.divergence import DivergenceGuard
from pjax.observe.metrics import (MetricsWriter, memory_per_device, mfu, model_flops_per_token, peak_flops,
                                  routing_group_tokens)
from pjax.observe.progress import ProgressBar


def local_devices(mesh: Any) -> list[Any]:
    """The mesh's devices this process drives (one host's)."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


class RunReport:
    """The loop's reporting, from step `start` on: `check` every step, `log` and `evaluate` when due."""

    def __init__(self, cfg: Any, ckpt: Any, trainer: Any, data: Any, memory: tuple[int, int], progress: bool,
                 start: int) -> None:
        tc, axes = cfg.train, trainer.mesh.shape
        # A curriculum's shorter windows hold the same tokens per routing group, fewer attention FLOPs per token.
        group = routing_group_tokens(tc.batch_size, tc.grad_accum, tc.seq_len, data_size(trainer.mesh), axes["cp"])
        self.flops_per_token = functools.cache(lambda length: model_flops_per_token(cfg.model, length, cfg.moe, group))
        self.peak = peak_flops(jax.devices()[0], cfg.log.peak_flops)
        self.tokens_per_step = tc.batch_size * tc.seq_len
        self.cfg, self.ckpt, self.trainer, self.data, self.memory, self.start = cfg, ckpt, trainer, data, memory, start
        self.local = local_devices(trainer.mesh)
        self.writer = MetricsWriter(cfg.log.dir, start)  # a resumed run continues its metrics.jsonl
        self.guard = DivergenceGuard(tc.on_nonfinite, tc.max_skipped, cfg.log.spike_sigma)
        self.bar = ProgressBar(tc.steps, mode=("bar" if progress else "lines") if jax.process_index() == 0 else "off",
                               initial=start)
        self.records: list[dict[str, Any]] = []
        self.drops_said = False
        self.t_last, self.steps_since, self.flops_since, self.length = time.perf_counter(), 0, 0.0, tc.seq_len

    def write(self, record: dict[str, Any]) -> None:
        self.writer.write(record)
        self.records.append(record)

    def check(self, step: int, metrics: dict) -> dict:
        """Bring one step's metrics to the host and hand them to the divergence guard."""
        host = jax.device_get(metrics)
        record, warning = self.guard.observe(step, float(host["loss"]), float(host["grad_norm"]), bool(host["finite"]),
                                             self.ckpt.last_good() if self.ckpt is not None else None)
        if record is not None:
            self.write(record)
        if warning is not None:
            self.bar.warn(warning)
        self._warn_on_dropless_drops(step, host)
        return host

    def _warn_on_dropless_drops(self, step: int, host: dict) -> None:
        """One line per run, the first time a capped dropless receive buffer drops (capacity routing drops by design)."""
        moe = self.cfg.moe
        if self.drops_said or moe.routing != "dropless" or not float(host.get("dropped_fraction", 0.0)) > 0:
            return
        self.drops_said = True
        self.bar.warn(f"warning: step {step}: moe.receive_factor={moe.receive_factor} dropped "
                      f"{float(host['dropped_fraction']):.2%} of the expert assignments (dropped_fraction in "
                      f"metrics.jsonl); raise it, or set it to null to never drop.")

    def took(self, length: int) -> None:
        """Count one step, on windows of `length` tokens, towards the next log record."""
        self.steps_since += 1
        self.flops_since += self.flops_per_token(length)
        self.length = length

    def log(self, step: int, host: dict) -> None:
        """The steps since the last log as one record: loss, throughput, MFU, memory, data wait."""
        step_time = (time.perf_counter() - self.t_last) / self.steps_since
        tps = self.tokens_per_step / step_time
        record = {"step": step, "loss": float(host["loss"]), "grad_norm": float(host["grad_norm"]),
                  "lr": float(host["lr"]), "tokens_per_sec": tps,
                  "mfu": mfu(tps, self.flops_since / self.steps_since, self.trainer.mesh.devices.size, self.peak),
                  "seq_len": self.length,
                  "step_time_s": step_time, "data_wait_s": self.data.take_wait() / self.steps_since,
                  "skipped_steps": self.guard.skipped, **memory_per_device(self.local, self.memory),
                  **{k: float(host[k]) for k in (*ROUTER_METRICS, "adapted_loss") if k in host}}
        if step - self.start == self.steps_since:
            record["includes_compile"] = True
        self.write(record)
        self.bar.update(self.steps_since, record)
        self.t_last, self.steps_since, self.flops_since = time.perf_counter(), 0, 0.0

    def evaluate(self, step: int, state: Any) -> None:
        """The held-out loss, kept out of the training throughput."""
        t_eval = time.perf_counter()
        batches = self.data.eval_batches(self.cfg.log.eval_batches)
        eval_loss = float(np.mean([float(self.trainer.loss(state.params, batch)) for batch in batches]))
        self.write({"step": step, "eval_loss": eval_loss})
        self.bar.note(f"step {step}: held-out loss {eval_loss:.4f}")
        self.t_last += time.perf_counter() - t_eval

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        if jax.process_index() == 0:
            print(f"metrics: {self.writer.path}")
