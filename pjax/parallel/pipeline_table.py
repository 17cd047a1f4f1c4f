"""What the pipeline executor reads each tick: the schedule a config asks for, turned into an int
table, and how often each conditional part of a tick really runs.

The executor (`pipeline_parallel.py`) scans over the rows of `executor_table`; each row holds,
per device, the op to run, its micro-batch, chunk and slot, the slots the arriving activation
and cotangent go to, whether the device has real work, and two flags that are the same on every
device: whether any device sends an activation on, or a cotangent back, this tick. A tick
without a sender skips that transfer altogether; one `ppermute` spans every stage, so only a
flag every device agrees on may skip it.

A tick's forward, backward, embedding, loss and transfers are loops of zero or one trip, which
XLA counts as one trip of unknown length: a collective inside them appears once per tick in the
compiled program. `scope_runs` says how many times per step an average device runs each of them,
read off the same table, so that `benchmarks/comm.py` can count their collectives as they run.
The executor names each part with `jax.named_scope(SCOPES[...])`, which XLA keeps in op names.
"""
from __future__ import annotations

import jax
import numpy as np

from mesh.errors import ConfigError
from mesh.mesh import CP, MeshConfig
from pjax.config import PipelineConfig
from pjax.parallel import pipeline_schedules as ps

COLUMNS = ("op", "mb", "chunk", "slot", "recv_x", "recv_dy", "active", "send_x", "send_dy")
SCOPES = {"forward": "pp_forward", "backward": "pp_backward", "embed": "pp_embed", "loss": "pp_loss",
          "send_x": "pp_send_x", "send_dy": "pp_send_dy"}


def validate_pipeline(mesh: MeshConfig, pipeline: PipelineConfig, num_layers: int, grad_accum: int) -> None:
    """Check that the layers split into pp * v stages and the micro-batches suit the schedule."""
    pp, v = mesh.pp, pipeline.virtual_stages
    if v > 1 and pipeline.schedule != "interleaved":
        raise ConfigError(f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved; "
                          f"set pipeline.virtual_stages=1 for {pipeline.schedule}.")
    if num_layers % (pp * v):
        raise ConfigError(f"model.num_hidden_layers={num_layers} is not divisible by mesh.pp*pipeline.virtual_stages"
                          f" = {pp}*{v}; choose a pp and virtual_stages whose product divides the layers.")
    if pipeline.schedule == "interleaved" and grad_accum % pp:
        raise ConfigError(f"train.grad_accum={grad_accum} is not a multiple of mesh.pp={pp}; the interleaved "
                          f"schedule needs micro-batches in groups of pp.")


def make_schedule(pipeline: PipelineConfig, pp: int, m: int, lockstep: bool = False) -> ps.Schedule:
    """The table `pipeline.schedule` gives for pp devices and m micro-batches; with `lockstep`,
    one kind of op per tick (1F1B takes its own lockstep form, other tables are split)."""
    name = "1f1b_lockstep" if lockstep and pipeline.schedule == "1f1b" else pipeline.schedule
    sched = ps.SCHEDULES[name](pp, m, pipeline.virtual_stages)
    return ps.lockstep(sched) if lockstep else sched


def needs_lockstep() -> bool:
    """With cp > 1 every stage's forward and backward hold ring-attention transfers, so every
    device must run the same kind of op each tick (`ps.lockstep`)."""
    return jax.sharding.get_abstract_mesh().shape[CP] > 1


def executor_table(sched: ps.Schedule, lockstep: bool = False) -> np.ndarray:
    """int32 [ticks, p, len(COLUMNS)]. In lockstep (`ps.lockstep`) `op` is the tick's one kind of
    op on every device, and a device without work runs it on the discard slot (`active` = 0)."""
    plan = ps.buffer_plan(sched)
    active = sched.op != ps.IDLE
    op, slot = sched.op, plan.slot
    if lockstep:
        op = np.broadcast_to(ps.tick_ops(sched)[:, None], sched.op.shape)
        slot = np.where(active, plan.slot, plan.slots)  # the discard slot, shared with "nothing came"
    # Slot `plan.slots` means "nothing came": a tick sends when some device receives into a real slot.
    send_x, send_dy = ((recv != plan.slots).any(axis=1, keepdims=True) for recv in (plan.recv_x, plan.recv_dy))
    columns = [op, sched.mb, sched.chunk, slot, plan.recv_x, plan.recv_dy, active,
               np.broadcast_to(send_x, op.shape), np.broadcast_to(send_dy, op.shape)]
    return np.stack(columns, axis=-1).astype(np.int32)


def scope_runs(sched: ps.Schedule, lockstep: bool = False) -> dict[str, float]:
    """Times per step an average device runs each part of a tick (keys of SCOPES), by the
    executor's own predicates on its table."""
    table = executor_table(sched, lockstep)
    col = {name: table[..., i] for i, name in enumerate(COLUMNS)}
    device = np.arange(sched.p)[None, :]
    forward, backward = col["op"] == ps.FORWARD, col["op"] == ps.BACKWARD
    first = (col["chunk"] == 0) & (device == 0)
    last = (col["chunk"] == sched.v - 1) & (device == sched.p - 1)
    runs = {"forward": forward, "backward": backward, "embed": forward & first, "loss": forward & last,
            "send_x": col["send_x"] > 0, "send_dy": col["send_dy"] > 0}
    return {name: float(r.sum()) / sched.p for name, r in runs.items()}
