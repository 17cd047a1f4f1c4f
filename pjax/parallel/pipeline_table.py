"""What the pipeline executor reads each tick: the schedule a config asks for, turned into an int
table, and how often each conditional part of a tick really runs.

The executor (`pipeline_parallel.py`) scans over the rows of `executor_table`; each row holds,
per device, the op to run, its micro-batch, chunk and slot, the slots the arriving activation
and cotangent go to, whether the device has real work, and two numbers that are the same on
every device: which devices send an activation on, and which a cotangent back, this tick (0:
none; k: the k-th distinct set of senders, `send_patterns`). Every device must take part in a
collective, so only a number every device agrees on may choose one: the executor holds one
`ppermute` per set of senders, with exactly their pairs, and runs the one the tick names (in
1F1B's warm-up, only the first stages send; a single permute over every stage would send a
useless block from each of the others).

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
SCOPES = {"forward": "pp_forward", "backward": "pp_backward", "weight": "pp_weight", "embed": "pp_embed",
          "loss": "pp_loss"}


def scope_name(part: str) -> str:
    """The named scope of a tick's part: SCOPES, or 'pp_send_x_3_' for `send_x_3`, the transfer of
    the third set of senders (no name is a prefix of another)."""
    return SCOPES.get(part, f"pp_{part}_")


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


def validate_split_backward(mesh: MeshConfig, pipeline: PipelineConfig, sequence_parallel: bool,
                            experts: int) -> None:
    """Zero-bubble schedules (B and W items) run dense layers, without sequence parallelism, and
    without cp (whose lockstep ticks would split every W from the B beside it)."""
    if pipeline.schedule != "zb_h1":
        return
    for bad, what in [(mesh.cp > 1, f"mesh.cp={mesh.cp}"), (sequence_parallel and mesh.tp > 1, "train.sequence_parallel"),
                      (experts > 0, "a Mixture-of-Experts model")]:
        if bad:
            raise ConfigError(f"pipeline.schedule=zb_h1 does not run with {what} yet; use pipeline.schedule=1f1b.")


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
    send_x, send_dy = (_pattern_ids(recv, plan.slots)[0] for recv in (plan.recv_x, plan.recv_dy))
    columns = [op, sched.mb, sched.chunk, slot, plan.recv_x, plan.recv_dy, active,
               np.broadcast_to(send_x[:, None], op.shape), np.broadcast_to(send_dy[:, None], op.shape)]
    return np.stack(columns, axis=-1).astype(np.int32)


def _pattern_ids(recv: np.ndarray, nothing: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Per tick the id of its set of receiving devices (0: none; k >= 1: the k-th distinct set in
    the order they first occur), and the sets. Slot `nothing` means "nothing came"."""
    sets: list[tuple[int, ...]] = []
    ids = np.zeros(recv.shape[0], np.int32)
    for t, row in enumerate(recv):
        receivers = tuple(int(d) for d in np.flatnonzero(row != nothing))
        if receivers:
            if receivers not in sets:
                sets.append(receivers)
            ids[t] = sets.index(receivers) + 1
    return ids, sets


def send_patterns(sched: ps.Schedule, lockstep: bool = False) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The distinct sets of devices that receive an activation, and a cotangent, on some tick (the
    send columns of `executor_table` number them from 1)."""
    plan = ps.buffer_plan(sched)
    return _pattern_ids(plan.recv_x, plan.slots)[1], _pattern_ids(plan.recv_dy, plan.slots)[1]


def scope_runs(sched: ps.Schedule, lockstep: bool = False) -> dict[str, float]:
    """Times per step an average device runs each part of a tick (the keys of SCOPES, and
    `send_x_k` / `send_dy_k` for the transfer of the k-th set of senders), by the executor's own
    predicates on its table."""
    table = executor_table(sched, lockstep)
    col = {name: table[..., i] for i, name in enumerate(COLUMNS)}
    device = np.arange(sched.p)[None, :]
    forward, backward = col["op"] == ps.FORWARD, col["op"] == ps.BACKWARD
    first = (col["chunk"] == 0) & (device == 0)
    last = (col["chunk"] == sched.v - 1) & (device == sched.p - 1)
    runs = {"forward": forward, "backward": backward, "weight": col["op"] == ps.WEIGHT,
            "embed": forward & first, "loss": forward & last}
    x_sets, dy_sets = send_patterns(sched, lockstep)
    runs |= {f"send_x_{k}": col["send_x"] == k for k in range(1, len(x_sets) + 1)}
    runs |= {f"send_dy_{k}": col["send_dy"] == k for k in range(1, len(dy_sets) + 1)}
    return {name: float(r.sum()) / sched.p for name, r in runs.items()}
