"""Pipeline parallelism: layers split into stages over `pp`, any schedule table run by one scan. `Pipelined`
picks the table (`table.make_schedule`), cuts the model into a stage (`stage.py`) and runs the executor
(`executor.py`) in a shard_map."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import replica_groups
from mesh.errors import ConfigError
from mesh.mesh import DP, PP, current
from models.config import LlamaConfig
from pjax.parallel import data_parallel, feedback, groups
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.executor import Batch, executor
from pjax.parallel.pipeline.stage import Stage, make_stage
from pjax.parallel.pipeline.table import make_schedule, needs_lockstep


def _run(sched: ps.Schedule, stage: Stage, params: Any, batch: Batch, lockstep: bool, once: bool, cfg: LlamaConfig,
         zero: int, with_grads: bool = True, mode: str = "none", residual: Any = None) -> tuple[Any, ...]:
    """The executor in a shard_map over pp, and with `once` over the data axes too, reducing the
    gradients once after the scan (ARCHITECTURE.md, "Gradients reduced once per step"); with a compression
    `mode` and its feedback state `residual`, the new state comes fourth."""
    data = data_parallel.data_axes(current()) if once else ()
    split = zero == 1 and data_parallel.zero_axes(data) is not None
    table = executor(sched, stage, lockstep)[1]

    def body(params, batch, table, residual):
        kept = {}

        def reduce(g):
            g, kept["residual"] = data_parallel.reduce_gradients(g, cfg, split, mode, residual)
            return g

        run = executor(sched, stage, lockstep, (reduce if once else (lambda g: g)) if with_grads else None)[0]
        return (*run(params, batch, table), kept.get("residual"))

    specs = data_parallel.data_specs(cfg, data, pipelined=True)
    grad_specs = data_parallel.data_specs(cfg, data, split, pipelined=True) if with_grads else P()
    res_specs = None if residual is None else feedback.pipelined_specs(cfg, data, residual)
    run = jax.shard_map(body, in_specs=(specs, data_parallel.batch_spec(data), P(None, PP), res_specs),
                        out_specs=(P(), grad_specs, P(), res_specs), axis_names={PP, *data})
    out = run(params, batch, jnp.asarray(table), residual)
    return out if residual is not None else out[:3]


def _run_per_replica(sched: ps.Schedule, stage: Stage, stacked_params: Any, batch: Batch, lockstep: bool,
                     cfg: LlamaConfig, group_size: int, scatter: bool = False) -> tuple[jax.Array, Any, dict]:
    """The executor once per dp replica on [replicas, ...] parameters: each replica's gradients summed over its
    expert group's ep and cp (`data_parallel.reduce_gradients`) and its group of `group_size` replicas
    (`groups.group_sum`; with `scatter`, each replica's chunk of that sum, `data_parallel.scatter_in_group`),
    stacked again (DiLoCo's groups, `pjax.parallel.outer`), the loss summed over everything, and the groups'
    router metrics averaged."""
    data = data_parallel.replica_axes(current())
    in_group = data[1:]

    def reduce(g: Any) -> Any:
        g = data_parallel.reduce_gradients(g, cfg, False, axes=in_group)[0]
        return data_parallel.scatter_in_group(g, cfg, group_size) if scatter else groups.group_sum(g, group_size)

    run, table = executor(sched, stage, lockstep, reduce)

    def body(params, batch, table):
        with replica_groups.replica_groups(group_size):
            loss, grads, router = run(jax.tree.map(lambda x: x[0], params), batch, table)
        return loss, jax.tree.map(lambda g: g[None], grads), router

    specs = data_parallel.stacked_specs(data_parallel.data_specs(cfg, data, pipelined=True))
    return jax.shard_map(body, in_specs=(specs, data_parallel.batch_spec(data), P(None, PP)),
                         out_specs=(P(), specs, P()), axis_names={PP, *data})(stacked_params, batch,
                                                                            jnp.asarray(table))


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """The gradients with pp > 1, run by `pipeline.schedule`'s table or by `schedule` (`ps.from_orders`; same p, m, v)."""

    spec: Any  # a `pjax.spec.StepSpec`
    zero: int
    grad_sharding: Any
    pipeline: Any  # a `pjax.config.PipelineConfig`
    schedule: ps.Schedule | None = None
    compression: str = "none"  # train.grad_compression: the once-per-step reduction's payload

    def loss_and_grads(self, params: Any, batch: Batch) -> tuple[jax.Array, Any, dict]:
        """Mean token loss of the global batch, its gradient, and the router metrics (MoE; else {})."""
        lockstep = needs_lockstep()
        loss, grads, router = self._execute(self._table(batch["inputs"].shape[0], lockstep), params, batch, lockstep)
        if self.grad_sharding is not None:  # ZeRO: gradients live in slices
            grads = lax.with_sharding_constraint(grads, self.grad_sharding)
        return loss, grads, router

    def compressed_loss_and_grads(self, params: Any, batch: Batch, residual: Any) -> tuple[Any, ...]:
        """`loss_and_grads` with the once-per-step reduction's payload compressed (`train.grad_compression`),
        and the new error-feedback state fourth."""
        lockstep = needs_lockstep()
        loss, grads, router, residual = self._execute(self._table(batch["inputs"].shape[0], lockstep), params,
                                                      batch, lockstep, residual=residual)
        if self.grad_sharding is not None:
            grads = lax.with_sharding_constraint(grads, self.grad_sharding)
        return loss, grads, router, residual

    def per_replica_loss_and_grads(self, stacked_params: Any, batch: Batch, group_size: int = 1,
                                   scatter: bool = False) -> tuple[jax.Array, Any, dict]:
        """The global batch's mean loss, each dp replica's mean gradient on its group's rows from its own
        [replicas, ...] parameters (`data_parallel.per_replica`'s, through the pipeline; with `scatter`, its
        chunk of the group's), and the groups' mean router metrics."""
        lockstep = needs_lockstep()
        count = current().shape[DP] // group_size  # groups, each of group_size replicas
        stage = make_stage(self.spec, count / batch["labels"].size, data_manual=True)
        sched = self._table(batch["inputs"].shape[0], lockstep)
        loss, grads, router = _run_per_replica(sched, stage, stacked_params, batch, lockstep, self.spec.cfg,
                                               group_size, scatter)
        return loss / count, grads, router

    def mean_loss(self, params: Any, batch: Batch) -> jax.Array:
        """Mean token loss (with MoE router losses) without gradients, through a forwards-only table."""
        pp, v = current().shape[PP], self.pipeline.virtual_stages
        sched = ps.forward_only(pp, batch["inputs"].shape[0], v, self.pipeline.vshape)
        return self._execute(sched, params, batch, needs_lockstep(), with_grads=False)[0]

    def _execute(self, sched: ps.Schedule, params: Any, batch: Batch, lockstep: bool, with_grads: bool = True,
                 residual: Any = None) -> tuple[Any, ...]:
        """`sched` run on this spec's stage (scaled to the batch's mean), gradients reduced once when they can be
        (compressed, with the new feedback state fourth, when a `residual` is given)."""
        once = data_parallel.can_reduce_once(current(), self.zero)
        stage = make_stage(self.spec, 1.0 / batch["labels"].size, data_manual=once)
        mode = "none" if residual is None else self.compression
        return _run(sched, stage, params, batch, lockstep, once, self.spec.cfg, self.zero, with_grads, mode, residual)

    def _table(self, m: int, lockstep: bool) -> ps.Schedule:
        """`pipeline.schedule`'s table for m micro-batches, or `schedule` once checked against it."""
        sched = make_schedule(self.pipeline, current().shape[PP], m, lockstep)
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
