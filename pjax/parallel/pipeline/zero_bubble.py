"""Zero-bubble schedules (Qi et al., 2024): each backward split into B and W.

B, the input gradient, is what the previous stage waits for; W, the weight gradients, nothing
waits for, so it can be run wherever a device would idle. Both schedules here are tables the
executor runs like any other (`pipeline/executor.py`; `models/deferred_grads.py` says what B
leaves W).

ZB-H1 is 1F1B with device s holding back s of its W's and running them where 1F1B's cool-down
idles; with F, B and W one tick each it takes 3m + p - 1 ticks, a bubble of (p - 1)/(3m + p - 1):
the papers' (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W).

ZB-V gives each device two chunks of half a stage's layers, placed in a V (device s holds model
stages s and 2p - 1 - s, `layout.stage_of`): a micro-batch goes down the devices and
back up, so the first device also computes the loss, and the warm-up and cool-down are short at
both ends. Its table is made by playing the ticks out (`zb_v`): each device runs a forward
while memory lets it, else a B, else a W, and a W first when its slots are all in use, within
1F1B's memory (2p slots of half a stage, counted as the executor holds them). With items of one
tick (half a stage) no table is shorter than 6m + p - 1 ticks, the last device waiting p - 1
ticks for its first input; played out this way it takes exactly that for every m >= p (checked
for p <= 16; p = 4, m = 8: 51 ticks against ZB-H1's 27 of whole stages): a bubble of
(p - 1)/(6m + p - 1), the last device's warm-up and nothing else.

An SPMD tick lasts as long as its slowest device, so these tables gain most when F, B and W
cost about the same. W lacks attention's backward, which is B's: where W is much shorter than
B, the ticks that pair them wait, and ZB-H1 can span more than lockstep 1F1B
(`Schedule.span`; benchmarks/README.md, "Zero-bubble").
"""
from __future__ import annotations

import numpy as np

from pjax.parallel.pipeline.layout import device_of, stage_of
from pjax.parallel.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule, from_orders


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's order with each backward split into B and W, device s running each W once it
    holds s + 1 W's (device 0 at once, the last device only when p are pending), the rest after
    its last B. The W's held back fill the ticks where 1F1B's cool-down waits for cotangents:
    3m + p - 1 ticks with every item one tick long, and a device holds 1F1B's p - s micro-batches'
    residuals between F and B."""
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order, pending = [(FORWARD, i, 0) for i in range(warmup)], []
        for k in range(m):
            if k + warmup < m:
                order.append((FORWARD, k + warmup, 0))
            order.append((BACKWARD, k, 0))
            pending.append(k)
            if len(pending) > s:
                order.append((WEIGHT, pending.pop(0), 0))
        orders.append(order + [(WEIGHT, i, 0) for i in pending])
    return from_orders("zb_h1", p, m, 1, orders)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per device in a V, played out tick by tick (see the module doc).

    Each tick a device runs the first of these that is ready: a W if all its slots are in use
    (so that its neighbours' activations can arrive), a forward, a B, a W; of two forwards or two
    B's, the second chunk's (it brings a micro-batch to its loss, or its cotangent down the V,
    sooner). Forwards go first as far as memory lets them (`_VPlay.ready`): memory paces the V."""
    play, rows = _VPlay(p, m), []
    while not play.finished():
        t = len(rows)
        rows.append([play.run(s, t) for s in range(p)])
        if all(op == IDLE for op, _, _ in rows[-1]):
            raise RuntimeError(f"zb_v deadlocks at p={p} m={m}, tick {t}")
    table = np.array(rows, dtype=np.int32)
    return Schedule("zb_v", p, m, 2, table[..., 0], table[..., 1], table[..., 2], vshape=True)


class _VPlay:
    """The state of `zb_v`'s play: what each device has run, and its slots.

    Slots are counted as `buffer_plan` gives them: `live[d]`, from an arrival (or device 0's own
    first forward) to its W; a forward runs only if its activation finds a free slot. A
    micro-batch that reaches a device's first chunk will need a second slot there before it can
    run its B's, so `owed[d]` counts the slots d's micro-batches hold or will hold until their B's
    (two on arrival, one less per B), and a forward may bring a micro-batch to d only if d can owe
    two more: the slots held beyond that wait only for W's, which a device can always run, so no
    micro-batch ever waits for a slot that never frees."""

    ORDER = ((FORWARD, 1), (FORWARD, 0), (BACKWARD, 1), (BACKWARD, 0), (WEIGHT, 0))

    def __init__(self, p: int, m: int):
        self.p, self.m, self.last, self.limit = p, m, 2 * p - 1, 2 * p
        self.done: dict[tuple[int, int, int], int] = {}  # (op, micro-batch, model stage) -> tick
        self.next = {(s, op, c): 0 for s in range(p) for op in (FORWARD, BACKWARD) for c in (0, 1)}
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # W's to run: (micro-batch, chunk)
        self.live, self.owed = [0] * p, [0] * p

    def finished(self) -> bool:
        return len(self.done) == 6 * self.m * self.p

    def _moves(self, s: int, c: int) -> tuple[list[int], list[int]]:
        """The devices a forward of chunk c on s gives an arrival, and those it brings a micro-batch to."""
        j = stage_of(s, c, self.p, vshape=True)
        arrive = ([s] if j == 0 else []) + ([device_of(j + 1, self.p, vshape=True)] if j < self.last else [])
        return arrive, ([s] if j == 0 else []) + ([s + 1] if c == 0 and s + 1 < self.p else [])

    def ready(self, s: int, op: int, c: int, t: int) -> bool:
        """Whether device s can run (op, chunk c) at tick t: its inputs were made before t and,
        for a forward, the slots it needs are free (see the class doc)."""
        if op == WEIGHT:
            return bool(self.pending[s])
        i, j = self.next[(s, op, c)], stage_of(s, c, self.p, vshape=True)
        before = lambda key: self.done.get(key, t) < t
        if i >= self.m:
            return False
        if op == BACKWARD:
            return before((FORWARD, i, j)) and (j == self.last or before((BACKWARD, i, j + 1)))
        arrive, enter = self._moves(s, c)
        return ((j == 0 or before((FORWARD, i, j - 1)))
                and all(self.live[d] + arrive.count(d) <= self.limit for d in arrive)
                and all(self.owed[d] + 2 <= self.limit for d in enter))

    def run(self, s: int, t: int) -> tuple[int, int, int]:
        """Device s's item at tick t, (op, micro-batch, chunk), recorded as run; IDLE if none is ready."""
        first = [(WEIGHT, 0)] if self.live[s] == self.limit else []
        op, c = next((k for k in first + list(self.ORDER) if self.ready(s, *k, t)), (IDLE, 0))
        if op == IDLE:
            return IDLE, 0, 0
        if op == WEIGHT:
            (i, c), self.live[s] = self.pending[s].pop(0), self.live[s] - 1
        else:
            i = self.next[(s, op, c)]
            self.next[(s, op, c)] += 1
        if op == BACKWARD:
            self.pending[s].append((i, c))
            self.owed[s] -= 1
        if op == FORWARD:
            arrive, enter = self._moves(s, c)
            for d in arrive:
                self.live[d] += 1
            for d in enter:
                self.owed[d] += 2
        self.done[(op, i, stage_of(s, c, self.p, vshape=True))] = t
        return op, i, c
