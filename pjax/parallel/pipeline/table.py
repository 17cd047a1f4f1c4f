"""What the pipeline executor reads each tick: the schedule as an int table (`executor_table`), and how often each
part of a tick really runs (`scope_runs`: XLA counts a zero-or-one-trip loop as one trip). Per lane, a row names the
set of sender pairs that transfers this tick (`send_patterns`): only a number every device agrees on may choose a
collective, and with one `ppermute` per set, stages with nothing to send send nothing."""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from mesh.backend import target_backend
from mesh.errors import ConfigError, require, require_choice
from mesh.mesh import CP, MeshConfig, current
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.buffers import buffer_plan
from pjax.parallel.pipeline.zero_bubble import zb_h1, zb_v
from pjax.parallel.pipeline.zero_bubble_lockstep import zb_h1_lockstep, zb_v_lockstep

SCHEDULE_NAMES = ("1f1b", "1f1b_lockstep", "afab", "interleaved", "zb_h1", "zb_v")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The config's `pipeline.*` keys."""

    schedule: str = "1f1b"
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        require_choice("pipeline.schedule", self.schedule, SCHEDULE_NAMES)
        require(self.virtual_stages >= 1, "pipeline.virtual_stages", self.virtual_stages, "use an integer >= 1")

    @property
    def vshape(self) -> bool:
        """Whether a device's chunks are placed in a V (zb_v), not round robin."""
        return self.schedule == "zb_v"


SCHEDULES: dict[str, Callable[[int, int, int], ps.Schedule]] = {
    "afab": lambda p, m, v: ps.afab(p, m),
    "1f1b": lambda p, m, v: ps.one_f_one_b(p, m),
    "1f1b_lockstep": lambda p, m, v: ps.one_f_one_b_lockstep(p, m),
    "interleaved": ps.interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
    "zb_v": lambda p, m, v: zb_v(p, m),
}
SPLIT_BACKWARD = ("zb_h1", "zb_v")
# cp > 1: the schedules with a lockstep table of their own; the others are split by `ps.lockstep`.
LOCKSTEP: dict[str, Callable[[int, int], ps.Schedule]] = {
    "1f1b": ps.one_f_one_b_lockstep, "zb_h1": zb_h1_lockstep, "zb_v": zb_v_lockstep}
COLUMNS = ("op", "mb", "chunk", "slot", "active")  # then per lane LANE_COLUMNS
LANE_COLUMNS = ("recv_x", "recv_dy", "send_x", "send_dy")
SCOPES = {"forward": "pp_forward", "backward": "pp_backward", "weight": "pp_weight", "embed": "pp_embed",
          "loss": "pp_loss"}


def scope_name(part: str) -> str:
    """The named scope of a tick's part: SCOPES, or 'pp_send_x_3_' for `send_x_3` (no name a prefix of another)."""
    return SCOPES.get(part, f"pp_{part}_")


def check_run(run) -> None:
    """The `pipeline.*` keys against the mesh and model of `run` (a `pjax.validate.Run`)."""
    mc, pipeline = run.mesh, run.pipeline
    check_xla_cpu(run)
    if mc.pp > 1:
        validate_pipeline(mc, pipeline, run.model.num_hidden_layers, run.train.grad_accum)
    elif (pipeline.schedule, pipeline.virtual_stages) != ("1f1b", 1):
        raise ConfigError(f"pipeline.schedule={pipeline.schedule} and pipeline.virtual_stages={pipeline.virtual_stages} "
                          f"apply only when mesh.pp > 1; set mesh.pp, or leave them at 1f1b and 1.")


def check_xla_cpu(run) -> None:
    """A zero-bubble schedule under sequence parallelism in bf16 aborts XLA:CPU (jax 0.10.2: an HLO check
    failure, "Invalid binary instruction opcode copy", killing the process): one line instead."""
    if target_backend() != "cpu":
        return
    policy = run.precision.resolve(run.train.dtype)
    if run.mesh.pp > 1 and (run.pipeline.schedule in SPLIT_BACKWARD and run.train.sequence_parallel and run.mesh.tp > 1
            and policy.embedding.name == "bfloat16"):
        raise ConfigError(f"pipeline.schedule={run.pipeline.schedule} with train.sequence_parallel=true in bf16 "
                          f"crashes XLA:CPU; on CPU use precision.preset=fp32, pipeline.schedule=1f1b or "
                          f"train.sequence_parallel=false.")


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


def make_schedule(pipeline: PipelineConfig, pp: int, m: int, lockstep: bool = False) -> ps.Schedule:
    """The table `pipeline.schedule` gives; with `lockstep`, one kind of op per tick."""
    if lockstep and pipeline.schedule in LOCKSTEP:
        return LOCKSTEP[pipeline.schedule](pp, m)
    sched = SCHEDULES[pipeline.schedule](pp, m, pipeline.virtual_stages)
    return ps.lockstep(sched) if lockstep else sched


def needs_lockstep() -> bool:
    """cp > 1: the ops hold ring-attention transfers, so every device runs one kind of op per tick."""
    return current().shape[CP] > 1


def executor_table(sched: ps.Schedule, lockstep: bool = False) -> np.ndarray:
    """int32 [ticks, p, len(COLUMNS) + lanes * len(LANE_COLUMNS)]; lockstep: `active` 0 runs on the discard slot."""
    plan = buffer_plan(sched)
    active = sched.op != ps.IDLE
    op, slot = sched.op, plan.slot
    if lockstep:
        op = np.broadcast_to(ps.tick_ops(sched)[:, None], sched.op.shape)
        slot = np.where(active, plan.slot, plan.slots)
    columns = [op, sched.mb, sched.chunk, slot, active]
    for lane in range(plan.lanes):
        send_x, send_dy = (_pattern_ids(senders[..., lane])[0] for senders in (plan.from_x, plan.from_dy))
        columns += [plan.recv_x[..., lane], plan.recv_dy[..., lane],
                    np.broadcast_to(send_x[:, None], op.shape), np.broadcast_to(send_dy[:, None], op.shape)]
    return np.stack(columns, axis=-1).astype(np.int32)


Pairs = tuple[tuple[int, int], ...]  # (sender, receiver) devices of one ppermute


def _pattern_ids(senders: np.ndarray) -> tuple[np.ndarray, list[Pairs]]:
    """Per tick the id of its set of (sender, receiver) pairs (0: none, else 1 + its index), and the sets."""
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
    """Per lane, the distinct sets of pairs that carry an activation, and a cotangent, on some tick."""
    plan = buffer_plan(sched)
    return ([_pattern_ids(plan.from_x[..., k])[1] for k in range(plan.lanes)],
            [_pattern_ids(plan.from_dy[..., k])[1] for k in range(plan.lanes)])


def send_scope(kind: str, lane: int, k: int) -> str:
    """The part name of lane `lane`'s transfer of the k-th set of pairs."""
    return f"send_{kind}{lane or ''}_{k}"


def scope_runs(sched: ps.Schedule, lockstep: bool = False) -> dict[str, float]:
    """Times per step an average device runs each part of a tick, by the executor's own predicates."""
    table = executor_table(sched, lockstep)
    col = {name: table[..., i] for i, name in enumerate(COLUMNS)}
    stage = sched.stage(np.arange(sched.p)[None, :], col["chunk"])
    forward, backward = col["op"] == ps.FORWARD, col["op"] == ps.BACKWARD
    weight = (col["op"] == ps.WEIGHT) & (col["active"] > 0)  # a device without a W skips it, in lockstep too
    runs = {"forward": forward, "backward": backward, "weight": weight,
            "embed": forward & (stage == 0), "loss": forward & (stage == sched.p * sched.v - 1)}
    x_sets, dy_sets = send_patterns(sched)
    for lane in range(len(x_sets)):
        lane_col = lambda name: table[..., len(COLUMNS) + lane * len(LANE_COLUMNS) + LANE_COLUMNS.index(name)]
        runs |= {send_scope("x", lane, k): lane_col("send_x") == k for k in range(1, len(x_sets[lane]) + 1)}
        runs |= {send_scope("dy", lane, k): lane_col("send_dy") == k for k in range(1, len(dy_sets[lane]) + 1)}
    return {name: float(r.sum()) / sched.p for name, r in runs.items()}


def part_runs(pipeline: PipelineConfig, pp: int, grad_accum: int, lockstep: bool
              ) -> Callable[[str], float | None]:
    """An HLO instruction's runs per tick, by the innermost tick part its op name is in; None outside every
    part (or without an op name)."""
    sched = make_schedule(pipeline, pp, grad_accum, lockstep)
    weights = {scope_name(part): runs / sched.ticks for part, runs in scope_runs(sched, lockstep).items()}

    def runs(line: str) -> float | None:
        name = re.search(r'op_name="([^"]*)"', line)
        found = [(name.group(1).rfind(scope), w) for scope, w in weights.items() if name and scope in name.group(1)]
        return max(found)[1] if found else None
    return runs


def tick_runs(pipeline: PipelineConfig, pp: int, grad_accum: int, lockstep: bool) -> Callable[[str, str], float]:
    """`pjax.observe.hlo.collective_stats`'s scale: an instruction's runs per tick, by its innermost scope (else 1)."""
    part = part_runs(pipeline, pp, grad_accum, lockstep)

    def runs(kind: str, line: str) -> float:
        found = part(line)
        return 1.0 if found is None else found
    return runs
