"""Zero-bubble schedules (Qi et al., 2024): each backward split into B and W.

B, the input gradient, is what the previous stage waits for; W, the weight gradients, nothing
waits for, so it can be run wherever a device would idle. Both schedules here are tables the
executor runs like any other (`pipeline_executor.py`; `models/deferred_grads.py` says what B
leaves W).

ZB-H1 is 1F1B with device s holding back s of its W's and running them where 1F1B's cool-down
idles; with F, B and W one tick each it takes 3m + p - 1 ticks, a bubble of (p - 1)/(3m + p - 1):
the papers' (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W).

ZB-V gives each device two chunks of half a stage's layers, placed in a V (device s holds model
stages s and 2p - 1 - s, `pipeline_layout.stage_of`): a micro-batch goes down the devices and
back up, so the first device also computes the loss, and the warm-up and cool-down are short at
both ends. Its table is made by playing the ticks out (`zb_v`): each device runs a B when one is
ready, else a forward unless that would hold more than 1F1B's memory, else a W. With items of
one tick (half a stage) it takes at least 6m + p - 1 ticks, the last device waiting p - 1 ticks
for its first input; played out this way it reaches that where m is a multiple of p for p = 3
and 4 (p = 4, m = 8: 51 ticks against ZB-H1's 27 of whole stages), and takes at most one tick
more than ZB-H1's time otherwise (the tests hold it to both).

Every op then costs about the same, so an SPMD tick wastes little on its slowest device.
"""
from __future__ import annotations

import numpy as np

from pjax.parallel.pipeline_layout import stage_of
from pjax.parallel.pipeline_schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule, from_orders


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

    A device keeps a chunk in a slot from the tick its input arrives (or its forward, on the first
    stage) to its W (`pipeline_buffers.buffer_plan`). A micro-batch that reaches a device's first
    chunk will also pass its second, so a forward down the V runs only while the devices it brings
    the micro-batch to have room for both: at most 2p slots (1F1B's p micro-batches of a whole
    stage). B's go oldest micro-batch first, forwards second chunk first
    (it brings a micro-batch to its loss and its backward sooner), W's in the order of their B's."""
    last, limit = 2 * p - 1, 2 * p
    stage = lambda s, c: stage_of(s, c, p, vshape=True)
    done: dict[tuple[int, int, int], int] = {}  # (op, micro-batch, model stage) -> tick
    next_f, next_b = [[0, 0] for _ in range(p)], [[0, 0] for _ in range(p)]  # per device and chunk
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # W's to run: (micro-batch, chunk)
    held = [0] * p  # slots in use or kept for a micro-batch's second chunk
    rows, t = [], 0
    before = lambda key: done.get(key, t) < t
    entering = lambda s, c: [] if c == 1 else [d for d in ([0] if s == 0 else []) + [s + 1] if d < p]
    while len(done) < 6 * m * p:
        row = []
        for s in range(p):
            bs = [(next_b[s][c], c) for c in (1, 0) if next_b[s][c] < m]
            bs = [(i, c) for i, c in bs if before((FORWARD, i, stage(s, c)))
                  and (stage(s, c) == last or before((BACKWARD, i, stage(s, c) + 1)))]
            fs = [(next_f[s][c], c) for c in (1, 0) if next_f[s][c] < m]
            fs = [(i, c) for i, c in fs if (stage(s, c) == 0 or before((FORWARD, i, stage(s, c) - 1)))
                  and all(held[d] + 2 <= limit for d in entering(s, c))]
            if bs:
                (i, c), op = min(bs), BACKWARD
                next_b[s][c] += 1
                pending[s].append((i, c))
            elif fs:
                (i, c), op = fs[0], FORWARD
                next_f[s][c] += 1
                for d in entering(s, c):
                    held[d] += 2
            elif pending[s]:
                (i, c), op = pending[s].pop(0), WEIGHT
                held[s] -= 1
            else:
                row.append((IDLE, 0, 0))
                continue
            row.append((op, i, c))
        for s, (op, i, c) in enumerate(row):
            if op != IDLE:
                done[(op, i, stage(s, c))] = t
        if all(op == IDLE for op, _, _ in row):
            raise RuntimeError(f"zb_v deadlocks at p={p} m={m}, tick {t}")
        rows.append(row)
        t += 1
    table = np.array(rows, dtype=np.int32)
    return Schedule("zb_v", p, m, 2, table[..., 0], table[..., 1], table[..., 2], vshape=True)
