"""Where a pipeline device keeps each micro-batch in flight (`slots`), and which lane of a tick's transfers brings it:
in a V a device may get two arrivals in one tick, so each lane is one partial permutation (ARCHITECTURE.md, "ZB-V")."""
from __future__ import annotations

import dataclasses

import numpy as np

from pjax.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, Schedule


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """`slot[t, s]`: device s's slot at tick t (0 when idle: read, written back unchanged); `recv_*[t, s, k]`: the slot
    lane k's arrival goes to, else the discard slot `slots` (arrivals are always written); `from_*`: sender or -1."""

    slots: int
    slot: np.ndarray
    recv_x: np.ndarray
    recv_dy: np.ndarray
    from_x: np.ndarray
    from_dy: np.ndarray

    @property
    def lanes(self) -> int:
        return self.recv_x.shape[-1]


def _colour(lives: dict[tuple[int, int, int], tuple[int, int]], p: int) -> tuple[dict, int]:
    """Slots for (device, mb, stage) -> (first, last tick), free again from the last (a tick reads before it writes),
    and the most any device needs; colouring in order of start is optimal."""
    slot_of, free_at = {}, {s: [] for s in range(p)}
    for key, (start, end) in sorted(lives.items(), key=lambda kv: kv[1]):
        frees = free_at[key[0]]
        k = next((k for k, f in enumerate(frees) if f <= start), len(frees))
        frees[k:k + 1] = [end]
        slot_of[key] = k
    return slot_of, max(len(f) for f in free_at.values())


def buffer_plan(sched: Schedule) -> BufferPlan:
    """A slot per (device, micro-batch, chunk) from its input's arrival to its backward (or W); arrivals in lanes."""
    p, last = sched.p, sched.p * sched.v - 1
    tick: dict[tuple[int, int, int], int] = {}
    for t, s in zip(*np.nonzero(sched.op)):
        tick[(int(sched.op[t, s]), int(sched.mb[t, s]), sched.stage(int(s), int(sched.chunk[t, s])))] = int(t)
    lives = {}
    for (op, i, j), t in tick.items():
        if op == FORWARD:
            arrival = tick[(FORWARD, i, j - 1)] if j > 0 else t
            end = tick.get((WEIGHT, i, j), tick.get((BACKWARD, i, j), t))
            lives[(sched.device_of(j), i, j)] = (arrival, end)
    slot_of, slots = _colour(lives, p)
    arrivals: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    plan_slot = np.zeros(sched.op.shape, np.int32)
    for t, s in zip(*np.nonzero(sched.op)):
        op, i, j = int(sched.op[t, s]), int(sched.mb[t, s]), sched.stage(int(s), int(sched.chunk[t, s]))
        plan_slot[t, s] = slot_of[(sched.device_of(j), i, j)]
        if op == FORWARD and j < last:
            d = sched.device_of(j + 1)
            arrivals.setdefault(("x", int(t)), []).append((d, int(s), slot_of[(d, i, j + 1)]))
        if op == BACKWARD and j > 0:
            d = sched.device_of(j - 1)
            arrivals.setdefault(("dy", int(t)), []).append((d, int(s), slot_of[(d, i, j - 1)]))
    lanes = max([1] + [max(np.bincount([d for d, _, _ in a])) for a in arrivals.values()])
    shape = (*sched.op.shape, lanes)
    recv = {kind: np.full(shape, slots, np.int32) for kind in ("x", "dy")}
    sender = {kind: np.full(shape, -1, np.int32) for kind in ("x", "dy")}
    for (kind, t), got in arrivals.items():
        for d, s, k in sorted(got):
            lane = int(np.sum(sender[kind][t, d] >= 0))
            recv[kind][t, d, lane], sender[kind][t, d, lane] = k, s
    return BufferPlan(slots, plan_slot, recv["x"], recv["dy"], sender["x"], sender["dy"])
