"""Pipeline schedules as data: tables of (tick x device) -> forward / backward / idle.

A schedule is built in two steps, both pure Python:

1. Each device gets its *program order*, the list of work items it runs, one after another:
   AFAB runs every forward then every backward; 1F1B runs `p - s - 1` warm-up forwards on
   device `s`, then alternates one forward and one backward, then drains the backwards.
2. `_timeline` (public as `from_orders`) places every item at the earliest tick its inputs are ready, one item per device
   per tick: the forward of micro-batch `i` on model stage `j` needs the forward of `i` on stage
   `j - 1` at an earlier tick; its backward needs its own forward and the backward of `i` on stage
   `j + 1`. A tick ends with one transfer (activations one device on, cotangents one device back),
   so "earlier" means at least one tick before.

With a forward and a backward taking one tick each, AFAB and 1F1B take 2(m + p - 1) ticks of
which 2m are busy on every device: the bubble is (p - 1)/(m + p - 1) for both. 1F1B's gain is
memory: a device holds at most p micro-batches' activations instead of m. Interleaved 1F1B
gives each device v chunks of 1/v of the layers (model stage `j = c*p + s` is chunk `c` on device
`s`); an item is 1/v as long and the bubble shrinks to (p - 1)/(v*m + p - 1).

Zero-bubble schedules split each backward into B (the input gradient) and W (the weight
gradients), a third kind of item (`pipeline/zero_bubble.py`).

In one SPMD program every device finishes a tick before the next starts, so a tick costs its
slowest item (`Schedule.span`). Lockstep 1F1B keeps 1F1B's bounded memory (2p - 1 in flight)
but lines up all forwards and all backwards, so it takes AFAB's time, which on separate devices
is below plain 1F1B's whenever a backward costs more than a forward.

The executor (`pipeline/executor.py`) runs any of these tables; `buffers.buffer_plan`
says in which slot of its fixed-size buffers a device keeps each micro-batch that is in flight.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mesh.errors import ConfigError
from pjax.parallel.pipeline.layout import device_of, stage_of

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
Item = tuple[int, int, int]  # (FORWARD, BACKWARD or WEIGHT, micro-batch, chunk on the device)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What every device does at every tick: `op`, `mb` and `chunk` are int arrays [ticks, p]."""

    name: str
    p: int  # devices (pipeline stages)
    m: int  # micro-batches
    v: int  # chunks per device (virtual stages); the model has p * v stages
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    vshape: bool = False  # chunks placed in a V, not round robin (`layout.stage_of`)

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def stage(self, device: int, chunk: int) -> int:
        """The model stage that `chunk` on `device` holds (`layout.stage_of`)."""
        return stage_of(device, chunk, self.p, self.vshape)

    def device_of(self, stage: int) -> int:
        """The device that holds model stage `stage`."""
        return device_of(stage, self.p, self.vshape)

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into B (input gradient) and W (weight gradients) items."""
        return bool(np.any(self.op == WEIGHT))

    def span(self, forward: float = 1.0, backward: float = 2.0, weight: float | None = None) -> float:
        """Time of the table when every tick lasts as long as its slowest device, as in one SPMD
        program on devices of their own (a whole backward costs about twice a forward). In a
        table with W items, `weight` of the backward (default half) is the W's and the rest B's."""
        weight = backward / 2 if weight is None else weight
        cost = np.array([0.0, forward, backward - weight, weight] if self.split_backward
                        else [0.0, forward, backward, 0.0])
        return float(cost[self.op].max(axis=1).sum())

    def bubble_fraction(self) -> float:
        """Idle (device, tick) cells over all cells, counting every item as one tick."""
        return float(np.mean(self.op == IDLE))

    def render(self) -> str:
        """The table as text: one row per device, `F3`/`B3`/`W3` = forward/backward/weight
        gradients of micro-batch 3 (with a chunk letter a, b, ... when v > 1), `.` = idle."""
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
    """Run each device's program order as early as the dependencies allow (see the module doc).

    `alternate`: forwards only on even ticks and backwards only on odd ones, so every tick runs
    one kind of op on all devices (ticks where no device can work are left out of the table).
    """
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
            t += 1  # the other kind of tick may have work; an all-idle tick itself is not kept
            continue
        skipped = 0
        for s, a in enumerate(row):
            if a is not None:
                done[(a[0], a[1], stage_of(s, a[2], p, vshape))] = t
                pos[s] += 1
        rows.append([a or (IDLE, 0, 0) for a in row])
        t += 1
    table = np.array(rows, dtype=np.int32)  # [ticks, p, 3]
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2], vshape)


def _forward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order a device runs its forwards: v = 1 simply 0..m-1;
    interleaved in groups of p micro-batches per chunk (Megatron-LM's order), so that the
    first chunk's outputs for a group reach device 0 again just as it needs them."""
    return [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]


def _one_f_one_b_order(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[Item]:
    """`warmup` forwards, then one forward / one backward alternately, then the remaining backwards."""
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
    """1F1B with every device forwarding on the same ticks and backwarding on the same ticks.

    Device s runs 2(p - s - 1) warm-up forwards (not p - s - 1), then alternates, and forwards /
    backwards take turns tick by tick. In an SPMD program a tick lasts as long as its slowest
    device, so plain 1F1B's steady state (some devices forwarding while others backward) costs a
    backward per tick; here a forward tick costs a forward. The time is that of AFAB and of
    asynchronous (MPMD) 1F1B, (m + p - 1)(F + B), with at most 2p - 1 micro-batches in flight
    instead of m. It is also what ring attention (cp > 1) needs: all stages in the same branch.
    """
    order = [(i, 0) for i in range(m)]
    return _timeline("1f1b_lockstep", p, m, 1, [_one_f_one_b_order(order, order, 2 * (p - s - 1)) for s in range(p)],
                     alternate=True)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B with v chunks per device; m must be a multiple of p (groups of p).

    The warm-up is 1F1B's p - s - 1 plus (v - 1) * p: the first group must pass through the first
    v - 1 chunks on every device before device s sees its first backward.
    """
    if m % p:
        raise ConfigError(f"train.grad_accum={m} is not a multiple of mesh.pp={p}; the interleaved schedule "
                          f"sends micro-batches round the devices in groups of pp.")
    fwd = _forward_order(p, m, v)
    bwd = [(i, v - 1 - c) for i, c in fwd]  # backwards visit the chunks in reverse
    orders = [_one_f_one_b_order(fwd, bwd, p - s - 1 + (v - 1) * p) for s in range(p)]
    return _timeline("interleaved" if v > 1 else "1f1b", p, m, v, orders)


def forward_only(p: int, m: int, v: int = 1, vshape: bool = False) -> Schedule:
    """Forwards only (evaluation): the loss without gradients, in the training layout (in a V,
    every micro-batch's way down the devices first, then the ways back up)."""
    order = [(FORWARD, i, c) for i, c in _forward_order(p, m, v)]
    if vshape:
        order = [(FORWARD, i, c) for c in range(v) for i in range(m)]
    return _timeline("forward", p, m, v, [order] * p, vshape=vshape)


def from_orders(name: str, p: int, m: int, v: int, orders: list[list[Item]], vshape: bool = False) -> Schedule:
    """A table from your own program orders: `orders[s]` lists device s's items (FORWARD,
    BACKWARD or WEIGHT, micro-batch, chunk) in the order it runs them; each is placed at the
    earliest tick its inputs are ready. Every item must appear exactly once on its device (W items
    for every backward, or none: a backward then computes the weight gradients too), and an order
    whose items wait on each other forever is reported as a deadlock."""
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
    """The same schedule with every tick's busy devices all forwarding or all backwarding.

    A tick where some devices forward while others backward is split in two: its forwards, then
    its backwards (each device keeps its program order, and a dependency that was one tick or more
    apart still is). The executor then runs one kind of op per tick on *every* device, the idle
    ones on a discard slot: what context parallelism needs, since ring attention's transfers sit
    inside the forward and backward and all stages must reach the same transfer together. The
    cost is the split ticks: interleaved 1F1B's steady state takes nearly twice as many (1F1B has
    a lockstep form of its own that costs nothing extra, `one_f_one_b_lockstep`). A table with no
    mixed tick comes back unchanged.
    """
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
    kinds = sched.op.max(axis=1)  # IDLE is 0
    if np.any((sched.op != IDLE) & (sched.op != kinds[:, None])):
        raise ValueError(f"schedule {sched.name} mixes forwards and backwards in a tick; pass it through lockstep()")
    return kinds


def plot_schedule(sched: Schedule, path: str) -> None:
    """Save the table as a PNG (`pjax.pictures.draw_schedule`)."""
    from pjax.pictures import draw_schedule, save

    save(draw_schedule(sched), path)
