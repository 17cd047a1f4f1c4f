"""Pipeline parallelism: layers split into stages over `pp`, any schedule table run by one scan.

`loss_and_grads` and `mean_loss` are what `pjax.step` calls instead of its own when pp > 1. They
pick the table (`table.make_schedule`: AFAB, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, or a
table of your own), cut the LLaMA into a stage (`pipeline/stage.py`), and run the executor
(`pipeline/executor.py`, which says how a tick works) in a `jax.shard_map` over pp, and over the
data axes too when each device can keep its own rows' gradients until the end (`_run`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import DP, PP
from models.config import LlamaConfig
from models.moe import MoeConfig
from pjax.config import PipelineConfig, TrainConfig
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


# --- Drop-ins for pjax.step's loss_and_grads and mean_loss when pp > 1 ------------------------------

def loss_and_grads(params: Any, batch: Batch, cfg: LlamaConfig, tc: TrainConfig, grad_sharding: Any = None,
                   attention_fn: Callable | None = None, *, pipeline: PipelineConfig, dtype: Any,
                   schedule: ps.Schedule | None = None, moe: MoeConfig = MoeConfig(),
                   with_router_metrics: bool = False) -> tuple[jax.Array, Any] | tuple[jax.Array, Any, dict]:
    """Mean token loss of the global batch and its gradient (and, `with_router_metrics`, an MoE
    model's router metrics, averaged over the micro-batches); batch arrays are [m, B, T] and the
    m = train.grad_accum micro-batches are the pipeline's.

    `schedule`: a table of your own (`ps.from_orders`) run instead of `pipeline.schedule`'s; its
    p, m and v must be the mesh's pp, the batch's m and `pipeline.virtual_stages`, and its chunks
    placed as `pipeline.schedule` places them (`vshape`: only zb_v's are in a V)."""
    pp = jax.sharding.get_abstract_mesh().shape[PP]
    lockstep = needs_lockstep()
    sched = make_schedule(pipeline, pp, batch["inputs"].shape[0], lockstep)
    if schedule is not None:
        if (schedule.p, schedule.m, schedule.v) != (sched.p, sched.m, sched.v):
            raise ConfigError(f"schedule {schedule.name} is for p={schedule.p} m={schedule.m} v={schedule.v}; this "
                              f"run has p={sched.p} m={sched.m} v={sched.v} (mesh.pp, train.grad_accum, "
                              f"pipeline.virtual_stages).")
        if schedule.vshape != sched.vshape:  # the stored layer order follows pipeline.schedule
            raise ConfigError(f"schedule {schedule.name} has vshape={schedule.vshape}, but the layers are stored "
                              f"for pipeline.schedule={pipeline.schedule}; build it with vshape={sched.vshape}.")
        sched = ps.lockstep(schedule) if lockstep else schedule
    once = data_parallel.can_reduce_once(jax.sharding.get_abstract_mesh(), tc.zero)
    stage = make_stage(cfg, tc, dtype, attention_fn, 1.0 / batch["labels"].size, moe, data_manual=once)
    loss, grads, router = _run(sched, stage, params, batch, lockstep, once, cfg, tc.zero)
    if grad_sharding is not None:  # ZeRO: gradients live in slices
        grads = lax.with_sharding_constraint(grads, grad_sharding)
    return (loss, grads, router) if with_router_metrics else (loss, grads)


def mean_loss(params: Any, batch: Batch, cfg: LlamaConfig, tc: TrainConfig, attention_fn: Callable | None = None,
              *, pipeline: PipelineConfig, dtype: Any, moe: MoeConfig = MoeConfig()) -> jax.Array:
    """Mean token loss without gradients (evaluation; with an MoE model's router losses, as in
    training), through a forwards-only table."""
    pp = jax.sharding.get_abstract_mesh().shape[PP]
    sched = ps.forward_only(pp, batch["inputs"].shape[0], pipeline.virtual_stages, pipeline.vshape)  # one kind of op: lockstep
    once = data_parallel.can_reduce_once(jax.sharding.get_abstract_mesh(), tc.zero)
    stage = make_stage(cfg, tc, dtype, attention_fn, 1.0 / batch["labels"].size, moe, data_manual=once)
    return _run(sched, stage, params, batch, needs_lockstep(), once, cfg, tc.zero, with_grads=False)[0]
