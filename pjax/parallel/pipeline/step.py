"""Pipeline parallelism: layers split into stages over `pp`, any schedule table run by one scan.

`Pipelined` is the strategy `pjax.step` builds instead of `Accumulation` when pp > 1. It picks
the table (`table.make_schedule`: AFAB, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, or a
table of your own), cuts the LLaMA into a stage (`pipeline/stage.py`), and runs the executor
(`pipeline/executor.py`, which says how a tick works) in a `jax.shard_map` over pp, and over the
data axes too when each device can keep its own rows' gradients until the end (`_run`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import DP, PP
from models.config import LlamaConfig
from pjax.parallel import data_parallel
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.executor import Batch, executor
from pjax.parallel.pipeline.stage import Stage, make_stage
from pjax.parallel.pipeline.table import make_schedule, needs_lockstep


def _run(sched: ps.Schedule, stage: Stage, params: Any, batch: Batch, lockstep: bool, once: bool, cfg: LlamaConfig,
         zero: int, with_grads: bool = True) -> tuple[jax.Array, Any, dict]:
    """The executor in a shard_map over pp, and over the data axes dp and cp too when `once`:
    then each device accumulates its own rows' partial gradients through every tick and they are
    reduced once, after the scan (`data_parallel.reduce_gradients`), where with dp automatic
    XLA reduces each tick's weight gradient over dp as soon as the tick computes it.
    Without `with_grads` (evaluation) the gradients are `{}`."""
    data = data_parallel.data_axes(jax.sharding.get_abstract_mesh()) if once else ()
    split = zero == 1 and DP in data
    reduce = (lambda g: data_parallel.reduce_gradients(g, cfg, split)) if once else (lambda g: g)
    body, table = executor(sched, stage, lockstep, reduce if with_grads else None)
    specs = data_parallel.data_specs(cfg, data, pipelined=True)  # layers over pp (and experts over dp when `once`)
    grad_specs = data_parallel.data_specs(cfg, data, split, pipelined=True) if with_grads else P()
    run = jax.shard_map(body, in_specs=(specs, data_parallel.batch_spec(data), P(None, PP)),
                        out_specs=(P(), grad_specs, P()), axis_names={PP, *data})
    return run(params, batch, jnp.asarray(table))


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """The step's gradients with pp > 1 (what `pjax.step.Accumulation` is for pp = 1): the
    train.grad_accum micro-batches ([m, B, T] batch arrays) are the pipeline's, run by
    `pipeline.schedule`'s table (or `schedule`, a table of your own from `ps.from_orders`: its p, m
    and v must be the mesh's pp, the batch's m and `pipeline.virtual_stages`, and its chunks
    placed as `pipeline.schedule` places them)."""

    spec: Any  # a `pjax.spec.StepSpec`
    zero: int
    grad_sharding: Any
    pipeline: Any  # a `pjax.config.PipelineConfig`
    schedule: ps.Schedule | None = None

    def loss_and_grads(self, params: Any, batch: Batch) -> tuple[jax.Array, Any, dict]:
        """Mean token loss of the global batch, its gradient, and the router metrics (MoE, averaged
        over the micro-batches; else {})."""
        lockstep = needs_lockstep()
        sched = self._table(batch["inputs"].shape[0], lockstep)
        once = data_parallel.can_reduce_once(jax.sharding.get_abstract_mesh(), self.zero)
        stage = make_stage(self.spec, 1.0 / batch["labels"].size, data_manual=once)
        loss, grads, router = _run(sched, stage, params, batch, lockstep, once, self.spec.cfg, self.zero)
        if self.grad_sharding is not None:  # ZeRO: gradients live in slices
            grads = lax.with_sharding_constraint(grads, self.grad_sharding)
        return loss, grads, router

    def mean_loss(self, params: Any, batch: Batch) -> jax.Array:
        """Mean token loss without gradients (evaluation; with an MoE model's router losses, as in
        training), through a forwards-only table (one kind of op: lockstep as it is)."""
        pp, v = jax.sharding.get_abstract_mesh().shape[PP], self.pipeline.virtual_stages
        sched = ps.forward_only(pp, batch["inputs"].shape[0], v, self.pipeline.vshape)
        once = data_parallel.can_reduce_once(jax.sharding.get_abstract_mesh(), self.zero)
        stage = make_stage(self.spec, 1.0 / batch["labels"].size, data_manual=once)
        return _run(sched, stage, params, batch, needs_lockstep(), once, self.spec.cfg, self.zero,
                    with_grads=False)[0]

    def _table(self, m: int, lockstep: bool) -> ps.Schedule:
        """`pipeline.schedule`'s table for m micro-batches, or `schedule` once checked against it."""
        sched = make_schedule(self.pipeline, jax.sharding.get_abstract_mesh().shape[PP], m, lockstep)
        mine = self.schedule
        if mine is None:
            return sched
        if (mine.p, mine.m, mine.v) != (sched.p, sched.m, sched.v):
            raise ConfigError(f"schedule {mine.name} is for p={mine.p} m={mine.m} v={mine.v}; this "
                              f"run has p={sched.p} m={sched.m} v={sched.v} (mesh.pp, train.grad_accum, "
                              f"pipeline.virtual_stages).")
        if mine.vshape != sched.vshape:  # the stored layer order follows pipeline.schedule
            raise ConfigError(f"schedule {mine.name} has vshape={mine.vshape}, but the layers are stored "
                              f"for pipeline.schedule={self.pipeline.schedule}; build it with vshape={sched.vshape}.")
        return ps.lockstep(mine) if lockstep else mine
