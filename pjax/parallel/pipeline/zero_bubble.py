"""Zero-bubble schedules (Qi et al., 2024): each backward split into B (the input gradient, which the previous stage
waits for) and W (the weight gradients, run where a device would idle; what B leaves W: `models/deferred_grads.py`).
A tick lasts its slowest item and W lacks attention's backward, so ZB-H1 can span more than lockstep 1F1B
(ARCHITECTURE.md, "Zero-bubble" and "ZB-V"; benchmarks/README.md, "Zero-bubble")."""
from __future__ import annotations

import numpy as np

from pjax.parallel.pipeline.layout import device_of, stage_of
from pjax.parallel.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule, from_orders


def zb_h1(p: int, m: int) -> Schedule:
    """1F1B's order, B and W split, device s holding back s W's for the cool-down: 3m + p - 1 ticks, 1F1B's memory."""
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
    """Two half-stage chunks per device in a V, played tick by tick in 1F1B's memory: 6m + p - 1 ticks for m >= p.
    Of two forwards or two B's the second chunk's runs first (it brings a loss, or a cotangent down the V, sooner)."""
    play, rows = VPlay(p, m), []
    while not play.finished():
        t = len(rows)
        rows.append([play.run(s, t) for s in range(p)])
        if all(op == IDLE for op, _, _ in rows[-1]):
            raise RuntimeError(f"zb_v deadlocks at p={p} m={m}, tick {t}")
    table = np.array(rows, dtype=np.int32)
    return Schedule("zb_v", p, m, 2, table[..., 0], table[..., 1], table[..., 2], vshape=True)


class VPlay:
    """The state of `zb_v`'s play. `live[d]`: slots held from arrival to W, as `buffer_plan` counts them. `owed[d]`:
    slots d's micro-batches hold or will hold until their B's (two on arrival, one less per B); a forward brings a
    micro-batch to d only if d can owe two more, so slots beyond wait only for W's, which always run: no deadlock."""

    ORDER = ((FORWARD, 1), (FORWARD, 0), (BACKWARD, 1), (BACKWARD, 0), (WEIGHT, 0))

    def __init__(self, p: int, m: int, limit: int | None = None):
        self.p, self.m, self.last, self.limit = p, m, 2 * p - 1, limit or 2 * p
        self.done: dict[tuple[int, int, int], int] = {}
        self.next = {(s, op, c): 0 for s in range(p) for op in (FORWARD, BACKWARD) for c in (0, 1)}
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.live, self.owed = [0] * p, [0] * p

    def finished(self) -> bool:
        return len(self.done) == 6 * self.m * self.p

    def _moves(self, s: int, c: int) -> tuple[list[int], list[int]]:
        """The devices a forward of chunk c on s gives an arrival, and those it brings a micro-batch to."""
        j = stage_of(s, c, self.p, vshape=True)
        arrive = ([s] if j == 0 else []) + ([device_of(j + 1, self.p, vshape=True)] if j < self.last else [])
        return arrive, ([s] if j == 0 else []) + ([s + 1] if c == 0 and s + 1 < self.p else [])

    def ready(self, s: int, op: int, c: int, t: int) -> bool:
        """Whether device s can run (op, chunk c) at tick t: inputs made before t, and a forward's slots free."""
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
        return (IDLE, 0, 0) if op == IDLE else self.record(s, t, op, c)

    def record(self, s: int, t: int, op: int, c: int) -> tuple[int, int, int]:
        """(op, chunk c) recorded as run by device s at tick t: (op, micro-batch, chunk); a W takes its oldest."""
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
