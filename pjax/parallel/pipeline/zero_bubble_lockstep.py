"""Zero-bubble tables in lockstep, for cp > 1 (ARCHITECTURE.md, "Zero-bubble in lockstep"). Forwards and B's hold
context parallelism's collectives (ring attention's permutes, all-gather's and Ulysses' exchanges, in the attention
and in its backward), so every device runs the same one of them on a tick, a discard one where it has none. A W holds
none: it is x^T g over this device's own tokens (summed over cp with the other gradients after the step), so W's get
ticks of their own, which a device without a W skips, and are held back until every device has one to run: W ticks
are then full, and a step spans (F rows + B rows) of lockstep 1F1B plus m W's, not m + p - 1 whole backwards."""
from __future__ import annotations

import numpy as np

from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule
from pjax.parallel.pipeline.zero_bubble import VPlay

Row = list[tuple[int, int, int]]


def zb_h1_lockstep(p: int, m: int) -> Schedule:
    """Lockstep 1F1B's forward and B ticks, and m full W ticks: 2(m + p - 1) + m ticks in 1F1B-lockstep's memory."""
    base = ps.one_f_one_b_lockstep(p, m)
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    rows: list[Row] = []
    for t in range(base.ticks):
        rows.append([(int(base.op[t, s]), int(base.mb[t, s]), int(base.chunk[t, s])) for s in range(p)])
        for s in np.nonzero(base.op[t] == BACKWARD)[0]:
            pending[s].append((int(base.mb[t, s]), int(base.chunk[t, s])))
        if BACKWARD in base.op[t] and all(pending):  # every device has a W: a full W tick
            rows.append(_weight_row(pending))
    while any(pending):
        rows.append(_weight_row(pending))
    return _table("zb_h1_lockstep", p, m, 1, rows, vshape=False)


def _weight_row(pending: list[list[tuple[int, int]]]) -> Row:
    """A W tick: each device with a W held back runs its oldest."""
    return [(WEIGHT, *queue.pop(0)) if queue else (IDLE, 0, 0) for queue in pending]


def zb_v_lockstep(p: int, m: int) -> Schedule:
    """ZB-V's V played in lockstep: a forward tick, a B tick, and a W tick when every device with W's to come has one
    ready, or one's slots are full (3p of half a stage: 1F1B-lockstep's memory is 4p - 2), or nothing else ran."""
    play, rows = VPlay(p, m, limit=3 * p), []
    while not play.finished():
        ran = _play_row(play, rows, FORWARD) | _play_row(play, rows, BACKWARD)
        waiting = [s for s in range(p) if play.pending[s] or any(play.next[(s, BACKWARD, c)] < m for c in (0, 1))]
        full = any(play.live[s] == play.limit and play.pending[s] for s in range(p))
        if all(play.pending[s] for s in waiting) or full or not ran:
            if not _play_row(play, rows, WEIGHT) and not ran:
                raise RuntimeError(f"zb_v_lockstep deadlocks at p={p} m={m}, tick {len(rows)}")
    return _table("zb_v_lockstep", p, m, 2, rows, vshape=True)


def _play_row(play: VPlay, rows: list[Row], kind: int) -> bool:
    """Append a tick of `kind` where every device runs its first ready item of that kind (in `VPlay.ORDER`), if any
    device has one; whether it did."""
    t = len(rows)
    if kind == WEIGHT:
        picks = [(WEIGHT, 0) if play.pending[s] else None for s in range(play.p)]
    else:
        picks = [next(((op, c) for op, c in play.ORDER if op == kind and play.ready(s, op, c, t)), None)
                 for s in range(play.p)]
    if not any(picks):
        return False
    rows.append([play.record(s, t, *k) if k else (IDLE, 0, 0) for s, k in enumerate(picks)])
    return True


def _table(name: str, p: int, m: int, v: int, rows: list[Row], vshape: bool) -> Schedule:
    table = np.array(rows, dtype=np.int32)
    return Schedule(name, p, m, v, table[..., 0], table[..., 1], table[..., 2], vshape=vshape)
