"""Where a pipeline device keeps each micro-batch in flight, and which transfers carry it there.

The executor (`pipeline/executor.py`) has fixed-size buffers: per device, `slots` rows for the
micro-batches it holds (their arriving activations and cotangents, a forward's residuals, what
B leaves W). `buffer_plan` gives each (device, micro-batch, chunk) a row for the ticks it lives,
and says which row each transfer's arrival goes to.

A tick ends with the transfers: every device that ran a forward sends its activation to the
device of the next model stage, every device that ran a backward its cotangent to the previous
stage's. A device sends at most one of each per tick, but may receive two: in a V (zb_v) the
devices on both sides can send to the same one, and the last device sends to itself. So the
arrivals of a tick are split into *lanes*, each a partial permutation (one `ppermute`): a
device's k-th arrival of the tick goes by lane k. Round-robin tables need one lane.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pjax.parallel.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, Schedule


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """Where each device keeps each micro-batch in flight: slots 0..slots-1.

    `slot[t, s]`: the slot of the micro-batch device s works on at tick t (0 when idle: an idle
    tick reads a slot and writes it back unchanged).
    `recv_x[t, s, k]`, `recv_dy[t, s, k]`: the slot for the activation / cotangent that arrives by
    lane k at the end of tick t, or `slots`, a spare discard slot, if none does: every tick writes
    its arrivals unconditionally. `from_x`, `from_dy` (the same shape): the device it comes from,
    or -1.
    """

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
    """Slots for (device, mb, stage) -> (first tick, last tick) intervals, per device, a slot free
    again from its last tick (reads come before writes within a tick); and the most any device needs.
    Interval colouring in order of start is optimal."""
    slot_of, free_at = {}, {s: [] for s in range(p)}  # per device: tick at which each slot frees
    for key, (start, end) in sorted(lives.items(), key=lambda kv: kv[1]):
        frees = free_at[key[0]]
        k = next((k for k, f in enumerate(frees) if f <= start), len(frees))
        frees[k:k + 1] = [end]
        slot_of[key] = k
    return slot_of, max(len(f) for f in free_at.values())


def buffer_plan(sched: Schedule) -> BufferPlan:
    """Give every (device, micro-batch, chunk) a slot from the tick its input arrives to its
    backward, or with B and W split to its W: the slot holds the forward's residuals until B,
    then what B leaves its W (`pipeline/slots.py`); and lay out each tick's arrivals in lanes.

    `slots` is the most micro-batches a device ever holds between arrival and backward (or W):
    p for 1F1B whatever m is, m for AFAB; ZB-H1 keeps 1F1B's p from arrival to W.
    """
    p, last = sched.p, sched.p * sched.v - 1
    tick: dict[tuple[int, int, int], int] = {}  # (op, micro-batch, model stage) -> tick
    for t, s in zip(*np.nonzero(sched.op)):
        tick[(int(sched.op[t, s]), int(sched.mb[t, s]), sched.stage(int(s), int(sched.chunk[t, s])))] = int(t)
    lives = {}  # (device, mb, stage) -> (first tick, last tick)
    for (op, i, j), t in tick.items():
        if op == FORWARD:
            arrival = tick[(FORWARD, i, j - 1)] if j > 0 else t
            end = tick.get((WEIGHT, i, j), tick.get((BACKWARD, i, j), t))
            lives[(sched.device_of(j), i, j)] = (arrival, end)
    slot_of, slots = _colour(lives, p)
    arrivals: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # (kind, tick) -> (receiver, sender, slot)
    plan_slot = np.zeros(sched.op.shape, np.int32)
    for t, s in zip(*np.nonzero(sched.op)):
        op, i, j = int(sched.op[t, s]), int(sched.mb[t, s]), sched.stage(int(s), int(sched.chunk[t, s]))
        plan_slot[t, s] = slot_of[(sched.device_of(j), i, j)]
        if op == FORWARD and j < last:  # the activation goes on to stage j + 1
            d = sched.device_of(j + 1)
            arrivals.setdefault(("x", int(t)), []).append((d, int(s), slot_of[(d, i, j + 1)]))
        if op == BACKWARD and j > 0:  # the cotangent goes back to stage j - 1
            d = sched.device_of(j - 1)
            arrivals.setdefault(("dy", int(t)), []).append((d, int(s), slot_of[(d, i, j - 1)]))
    lanes = max([1] + [max(np.bincount([d for d, _, _ in a])) for a in arrivals.values()])
    shape = (*sched.op.shape, lanes)
    recv = {kind: np.full(shape, slots, np.int32) for kind in ("x", "dy")}
    sender = {kind: np.full(shape, -1, np.int32) for kind in ("x", "dy")}
    for (kind, t), got in arrivals.items():
        for d, s, k in sorted(got):
            lane = int(np.sum(sender[kind][t, d] >= 0))  # the device's next free lane this tick
            recv[kind][t, d, lane], sender[kind][t, d, lane] = k, s
    return BufferPlan(slots, plan_slot, recv["x"], recv["dy"], sender["x"], sender["dy"])
