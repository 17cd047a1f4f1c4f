"""What the pipeline executor reads each tick: the schedule a config asks for, turned into an int
table, and how often each conditional part of a tick really runs.

The executor (`pipeline/executor.py`) scans over the rows of `executor_table`; each row holds,
per device, the op to run, its micro-batch, chunk and slot, whether the device has real work,
and per transfer lane (`pipeline/buffers.py`) the slots the arriving activation and cotangent go
to and two numbers that are the same on every device: which pairs of devices send an activation,
and which a cotangent, by that lane this tick (0: none; k: the k-th distinct set of pairs,
`send_patterns`). Every device must take part in a collective, so only a number every device
agrees on may choose one: the executor holds one `ppermute` per set of pairs and runs the one
the tick names (in 1F1B's warm-up, only the first stages send; a single permute over every stage
would send a useless block from each of the others).

A tick's forward, backward, embedding, loss and transfers are loops of zero or one trip, which
XLA counts as one trip of unknown length: a collective inside them appears once per tick in the
compiled program. `scope_runs` says how many times per step an average device runs each of them,
read off the same table, and `tick_runs` turns that into a weight per HLO instruction, so that
the planner and `benchmarks/comm.py` count their collectives as they run.
The executor names each part with `jax.named_scope(SCOPES[...])`, which XLA keeps in op names.
"""
from __future__ import annotations

import re
from typing import Callable

import jax
import numpy as np

from mesh.errors import ConfigError
from mesh.mesh import CP, MeshConfig
from pjax.config import PipelineConfig
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.buffers import buffer_plan
from pjax.parallel.pipeline.zero_bubble import zb_h1, zb_v

SCHEDULES: dict[str, Callable[[int, int, int], ps.Schedule]] = {
    "afab": lambda p, m, v: ps.afab(p, m),
    "1f1b": lambda p, m, v: ps.one_f_one_b(p, m),
    "1f1b_lockstep": lambda p, m, v: ps.one_f_one_b_lockstep(p, m),
    "interleaved": ps.interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
    "zb_v": lambda p, m, v: zb_v(p, m),
}
SPLIT_BACKWARD = ("zb_h1", "zb_v")  # schedules with W items
COLUMNS = ("op", "mb", "chunk", "slot", "active")  # then per lane LANE_COLUMNS
LANE_COLUMNS = ("recv_x", "recv_dy", "send_x", "send_dy")
SCOPES = {"forward": "pp_forward", "backward": "pp_backward", "weight": "pp_weight", "embed": "pp_embed",
          "loss": "pp_loss"}


def scope_name(part: str) -> str:
    """The named scope of a tick's part: SCOPES, or 'pp_send_x_3_' for `send_x_3`, the transfer of
    the third set of senders (no name is a prefix of another)."""
    return SCOPES.get(part, f"pp_{part}_")


def validate_pipeline(mesh: MeshConfig, pipeline: PipelineConfig, num_layers: int, grad_accum: int) -> None:
    """Check that the layers split into pp * v stages and the micro-batches suit the schedule."""
    pp, v = mesh.pp, pipeline.virtual_stages
    if pipeline.schedule == "zb_v" and v != 2:
        raise ConfigError(f"pipeline.schedule=zb_v places two chunks per device in a V; set "
                          f"pipeline.virtual_stages=2 (not {v}).")
    if v > 1 and pipeline.schedule not in ("interleaved", "zb_v"):
        raise ConfigError(f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved (or zb_v, with 2); "
                          f"set pipeline.virtual_stages=1 for {pipeline.schedule}.")
    if num_layers % (pp * v):
        raise ConfigError(f"model.num_hidden_layers={num_layers} is not divisible by mesh.pp*pipeline.virtual_stages"
                          f" = {pp}*{v}; choose a pp and virtual_stages whose product divides the layers.")
    if pipeline.schedule == "interleaved" and grad_accum % pp:
        raise ConfigError(f"train.grad_accum={grad_accum} is not a multiple of mesh.pp={pp}; the interleaved "
                          f"schedule needs micro-batches in groups of pp.")


def validate_split_backward(mesh: MeshConfig, pipeline: PipelineConfig, experts: int) -> None:
    """Zero-bubble schedules (B and W items) run dense layers, and without cp (whose lockstep
    ticks would split every W from the B beside it)."""
    if pipeline.schedule not in SPLIT_BACKWARD:
        return
    for bad, what in [(mesh.cp > 1, f"mesh.cp={mesh.cp}"), (experts > 0, "a Mixture-of-Experts model")]:
        if bad:
            raise ConfigError(f"pipeline.schedule={pipeline.schedule} does not run with {what} yet; "
                              f"use pipeline.schedule=1f1b.")


def make_schedule(pipeline: PipelineConfig, pp: int, m: int, lockstep: bool = False) -> ps.Schedule:
    """The table `pipeline.schedule` gives for pp devices and m micro-batches; with `lockstep`,
    one kind of op per tick (1F1B takes its own lockstep form, other tables are split)."""
    name = "1f1b_lockstep" if lockstep and pipeline.schedule == "1f1b" else pipeline.schedule
    sched = SCHEDULES[name](pp, m, pipeline.virtual_stages)
    return ps.lockstep(sched) if lockstep else sched


def needs_lockstep() -> bool:
    """With cp > 1 every stage's forward and backward hold ring-attention transfers, so every
    device must run the same kind of op each tick (`ps.lockstep`)."""
    return jax.sharding.get_abstract_mesh().shape[CP] > 1


def executor_table(sched: ps.Schedule, lockstep: bool = False) -> np.ndarray:
    """int32 [ticks, p, len(COLUMNS) + lanes * len(LANE_COLUMNS)]. In lockstep (`ps.lockstep`)
    `op` is the tick's one kind of op on every device, and a device without work runs it on the
    discard slot (`active` = 0)."""
    plan = buffer_plan(sched)
    active = sched.op != ps.IDLE
    op, slot = sched.op, plan.slot
    if lockstep:
        op = np.broadcast_to(ps.tick_ops(sched)[:, None], sched.op.shape)
        slot = np.where(active, plan.slot, plan.slots)  # the discard slot, shared with "nothing came"
    columns = [op, sched.mb, sched.chunk, slot, active]
    for lane in range(plan.lanes):
        send_x, send_dy = (_pattern_ids(senders[..., lane])[0] for senders in (plan.from_x, plan.from_dy))
        columns += [plan.recv_x[..., lane], plan.recv_dy[..., lane],
                    np.broadcast_to(send_x[:, None], op.shape), np.broadcast_to(send_dy[:, None], op.shape)]
    return np.stack(columns, axis=-1).astype(np.int32)


Pairs = tuple[tuple[int, int], ...]  # (sender, receiver) devices of one ppermute


def _pattern_ids(senders: np.ndarray) -> tuple[np.ndarray, list[Pairs]]:
    """Per tick the id of its set of (sender, receiver) pairs (0: none; k >= 1: the k-th distinct
    set in the order they first occur), and the sets; `senders[t, d]` is d's sender or -1."""
    sets: list[Pairs] = []
    ids = np.zeros(senders.shape[0], np.int32)
    for t, row in enumerate(senders):
        pairs = tuple((int(s), int(d)) for d, s in enumerate(row) if s >= 0)
        if pairs:
            if pairs not in sets:
                sets.append(pairs)
            ids[t] = sets.index(pairs) + 1
    return ids, sets


def send_patterns(sched: ps.Schedule) -> tuple[list[list[Pairs]], list[list[Pairs]]]:
    """Per lane, the distinct sets of (sender, receiver) pairs that carry an activation, and a
    cotangent, on some tick (the lanes' send columns of `executor_table` number them from 1)."""
    plan = buffer_plan(sched)
    return ([_pattern_ids(plan.from_x[..., k])[1] for k in range(plan.lanes)],
            [_pattern_ids(plan.from_dy[..., k])[1] for k in range(plan.lanes)])


def send_scope(kind: str, lane: int, k: int) -> str:
    """The part name of lane `lane`'s transfer of the k-th set of pairs: `send_x_3`, `send_x1_3`."""
    return f"send_{kind}{lane or ''}_{k}"


def scope_runs(sched: ps.Schedule, lockstep: bool = False) -> dict[str, float]:
    """Times per step an average device runs each part of a tick (the keys of SCOPES, and
    `send_scope(...)` for each lane's transfer of each set of pairs), by the executor's own
    predicates on its table."""
    table = executor_table(sched, lockstep)
    col = {name: table[..., i] for i, name in enumerate(COLUMNS)}
    stage = sched.stage(np.arange(sched.p)[None, :], col["chunk"])
    forward, backward = col["op"] == ps.FORWARD, col["op"] == ps.BACKWARD
    runs = {"forward": forward, "backward": backward, "weight": col["op"] == ps.WEIGHT,
            "embed": forward & (stage == 0), "loss": forward & (stage == sched.p * sched.v - 1)}
    x_sets, dy_sets = send_patterns(sched)
    for lane in range(len(x_sets)):
        lane_col = lambda name: table[..., len(COLUMNS) + lane * len(LANE_COLUMNS) + LANE_COLUMNS.index(name)]
        runs |= {send_scope("x", lane, k): lane_col("send_x") == k for k in range(1, len(x_sets[lane]) + 1)}
        runs |= {send_scope("dy", lane, k): lane_col("send_dy") == k for k in range(1, len(dy_sets[lane]) + 1)}
    return {name: float(r.sum()) / sched.p for name, r in runs.items()}


def tick_runs(pipeline: PipelineConfig, pp: int, grad_accum: int, lockstep: bool) -> Callable[[str, str], float]:
    """For `pjax.hlo.collective_stats(scale=...)`: how many times per tick an HLO instruction of the
    step runs, by the innermost of the executor's named scopes in its op name (`scope_runs` over
    the ticks; a collective outside them runs once). The tick loop's own trip count does the rest."""
    sched = make_schedule(pipeline, pp, grad_accum, lockstep)
    weights = {scope_name(part): runs / sched.ticks for part, runs in scope_runs(sched, lockstep).items()}

    def runs(kind: str, line: str) -> float:
        name = re.search(r'op_name="([^"]*)"', line)
        found = [(name.group(1).rfind(scope), w) for scope, w in weights.items() if name and scope in name.group(1)]
        return max(found)[1] if found else 1.0
    return runs
