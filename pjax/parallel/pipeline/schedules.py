"""Pipeline schedules as tick x device op tables (ARCHITECTURE.md, "Pipeline schedules as data, one SPMD program")."""
from __future__ import annotations

import dataclasses

import numpy as np

from mesh.errors import ConfigError
from pjax.parallel.pipeline.layout import device_of, stage_of

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
Item = tuple[int, int, int]  # (op, micro-batch, chunk on the device)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What every device does at every tick: `op`, `mb` and `chunk` are int arrays [ticks, p]."""

    name: str
    p: int
    m: int
    v: int  # chunks per device: the model has p * v stages
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    vshape: bool = False

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def stage(self, device: int, chunk: int) -> int:
        """The model stage that `chunk` on `device` holds."""
        return stage_of(device, chunk, self.p, self.vshape)

    def device_of(self, stage: int) -> int:
        """The device that holds model stage `stage`."""
        return device_of(stage, self.p, self.vshape)

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B and W items."""
        return bool(np.any(self.op == WEIGHT))

    def span(self, forward: float = 1.0, backward: float = 2.0, weight: float | None = None) -> float:
        """Time of the table when every tick lasts its slowest item; `weight` is W's share of a backward."""
        weight = backward / 2 if weight is None else weight
        cost = np.array([0.0, forward, backward - weight, weight] if self.split_backward
                        else [0.0, forward, backward, 0.0])
        return float(cost[self.op].max(axis=1).sum())

    def bubble_fraction(self) -> float:
        """Idle (device, tick) cells over all cells, counting every item as one tick."""
        return float(np.mean(self.op == IDLE))

    def render(self) -> str:
        """The table as text, one row per device: `F3a` = forward of micro-batch 3, chunk a; `.` = idle."""
        def cell(t: int, s: int) -> str:
            if self.op[t, s] == IDLE:
                return "."
            letter = chr(ord("a") + self.chunk[t, s]) if self.v > 1 else ""
            return ".FBW"[self.op[t, s]] + str(self.mb[t, s]) + letter
        width = max(len(cell(t, s)) for t in range(self.ticks) for s in range(self.p))
        title = (f"{self.name}: p={self.p} m={self.m} v={self.v}, {self.ticks} ticks, "
                 f"bubble {self.bubble_fraction():.3f}")
        rows = [f"device {s} | " + " ".join(cell(t, s).ljust(width) for t in range(self.ticks)).rstrip()
                for s in range(self.p)]
        return "\n".join([title, *rows])


def _timeline(name: str, p: int, m: int, v: int, orders: list[list[Item]], alternate: bool = False,
              vshape: bool = False) -> Schedule:
    """Each device's program order, an item a tick, as early as inputs allow; `alternate`: forwards on even ticks."""
    done: dict[tuple[int, int, int], int] = {}  # (op, micro-batch, model stage) -> tick
    pos, rows, t, skipped = [0] * p, [], 0, 0
    last = p * v - 1

    def ready(op: int, i: int, j: int) -> bool:
        if alternate and op != (FORWARD if t % 2 == 0 else BACKWARD):
            return False
        deps = [(FORWARD, i, j - 1)] if op == FORWARD and j > 0 else []
        if op == BACKWARD:
            deps = [(FORWARD, i, j)] + ([(BACKWARD, i, j + 1)] if j < last else [])
        if op == WEIGHT:
            deps = [(BACKWARD, i, j)]
        return all(done.get(d, t) < t for d in deps)

    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = [orders[s][pos[s]] if pos[s] < len(orders[s]) else None for s in range(p)]
        row = [a if a is not None and ready(a[0], a[1], stage_of(s, a[2], p, vshape)) else None
               for s, a in enumerate(row)]
        if not any(row):
            skipped += 1
            if not alternate or skipped > 1:
                raise RuntimeError(f"schedule {name} deadlocks at tick {t}: the program orders are inconsistent")
            t += 1
            continue
        skipped = 0
        for s, a in enumerate(row):
            if a is not None:
                done[(a[0], a[1], stage_of(s, a[2], p, vshape))] = t
                pos[s] += 1
        rows.append([a or (IDLE, 0, 0) for a in row])
        t += 1
    table = np.array(rows, dtype=np.int32)
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2], vshape)


def _forward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) forwards in groups of p per chunk (Megatron-LM's): a group is back at device 0 in time."""
    return [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]


def _one_f_one_b_order(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[Item]:
    warmup = min(warmup, len(forwards))
    order = [(FORWARD, *f) for f in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards):
        order += [(FORWARD, *f), (BACKWARD, *b)]
    return order + [(BACKWARD, *b) for b in backwards[len(forwards) - warmup:]]


def afab(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (GPipe): every device holds all m micro-batches' activations."""
    fwd = [(FORWARD, i, 0) for i in range(m)]
    return _timeline("afab", p, m, 1, [fwd + [(BACKWARD, i, 0) for i in range(m)] for _ in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): device s runs p - s - 1 forwards, then alternates; at most p in flight."""
    order = [(i, 0) for i in range(m)]
    return _timeline("1f1b", p, m, 1, [_one_f_one_b_order(order, order, p - s - 1) for s in range(p)])


def one_f_one_b_lockstep(p: int, m: int) -> Schedule:
    """1F1B with 2(p - s - 1) warm-up forwards and all devices forwarding on the same ticks."""
    order = [(i, 0) for i in range(m)]
    return _timeline("1f1b_lockstep", p, m, 1, [_one_f_one_b_order(order, order, 2 * (p - s - 1)) for s in range(p)],
                     alternate=True)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B, v chunks per device; the first group passes the first v - 1 chunks on every
    device before device s sees a backward, hence (v - 1) * p more warm-up forwards."""
    if m % p:
        raise ConfigError(f"train.grad_accum={m} is not a multiple of mesh.pp={p}; the interleaved schedule "
                          f"sends micro-batches round the devices in groups of pp.")
    fwd = _forward_order(p, m, v)
    bwd = [(i, v - 1 - c) for i, c in fwd]
    orders = [_one_f_one_b_order(fwd, bwd, p - s - 1 + (v - 1) * p) for s in range(p)]
    return _timeline("interleaved" if v > 1 else "1f1b", p, m, v, orders)


def forward_only(p: int, m: int, v: int = 1, vshape: bool = False) -> Schedule:
    """Forwards only (evaluation), in the training layout."""
    order = [(FORWARD, i, c) for i, c in _forward_order(p, m, v)]
    if vshape:
        order = [(FORWARD, i, c) for c in range(v) for i in range(m)]
    return _timeline("forward", p, m, v, [order] * p, vshape=vshape)


def from_orders(name: str, p: int, m: int, v: int, orders: list[list[Item]], vshape: bool = False) -> Schedule:
    """A table from your own program orders, each item once per device (W items for every backward or none)."""
    if len(orders) != p:
        raise ValueError(f"schedule {name}: {len(orders)} program orders for p={p} devices; give one per device.")
    split = any(int(item[0]) == WEIGHT for order in orders for item in order)
    ops = (FORWARD, BACKWARD, WEIGHT) if split else (FORWARD, BACKWARD)
    want = sorted((op, i, c) for op in ops for i in range(m) for c in range(v))
    for s, order in enumerate(orders):
        got = sorted(tuple(int(x) for x in item) for item in order)
        if got != want:
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            twice = len(got) - len(set(got))
            raise ValueError(f"schedule {name}: device {s} must run each (op, micro-batch, chunk) once: "
                             f"missing {missing[:4]}, unknown {extra[:4]}, {twice} repeated.")
    return _timeline(name, p, m, v, [[tuple(int(x) for x in item) for item in order] for order in orders],
                     vshape=vshape)


def lockstep(sched: Schedule) -> Schedule:
    """Each mixed tick split into its forwards, then its backwards: ring attention's transfers sit inside the ops."""
    if all(len(set(row.tolist()) - {IDLE}) <= 1 for row in sched.op):
        return sched
    rows = []
    for t in range(sched.ticks):
        ops = set(sched.op[t].tolist()) - {IDLE}
        for kind in sorted(ops) if len(ops) > 1 else [None]:
            keep = np.ones(sched.p, bool) if kind is None else sched.op[t] == kind
            rows.append([np.where(keep, a[t], 0) for a in (sched.op, sched.mb, sched.chunk)])
    op, mb, chunk = (np.array([r[k] for r in rows], np.int32) for k in range(3))
    return Schedule(sched.name + "-lockstep", sched.p, sched.m, sched.v, op, mb, chunk, sched.vshape)


def tick_ops(sched: Schedule) -> np.ndarray:
    """[ticks] the one kind of op each tick of a lockstep table runs (IDLE only if all devices idle)."""
    kinds = sched.op.max(axis=1)
    if np.any((sched.op != IDLE) & (sched.op != kinds[:, None])):
        raise ValueError(f"schedule {sched.name} mixes forwards and backwards in a tick; pass it through lockstep()")
    return kinds
