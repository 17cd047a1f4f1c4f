"""The zigzag layout every context-parallel strategy takes, and the chunk pairs it leaves to compute.

A contiguous split over cp is unbalanced under a causal mask: the device with the last tokens
attends to everything, the first only to itself. Cutting the sequence into 2*cp chunks and
giving device i the chunks (i, 2cp-1-i) -- one early, one late -- balances it. Call a device's
two chunks "early" (0) and "late" (1). When device i attends to the keys of device j:
  * late queries vs early keys: always entirely below the diagonal (2cp-1-i >= cp > j);
  * early queries vs late keys: always entirely above it -- skipped;
  * one "diagonal" pair (h, h): (early, early) if j < i, (late, late) if j > i; both, with a
    causal mask inside, when j == i (the device's own keys).
So every device computes 3 chunk pairs against its own keys and 2 against each other device's:
2cp+1 in all, the same on every device and exactly the pairs that are not entirely masked
(cp(2cp+1) over all devices). `zigzag_schedule` lists them in the ring's order.

Plain Python: the data pipeline permutes its batches with `zigzag_layout`, and the tests check
the schedule the ring runs.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mesh.errors import ConfigError


def zigzag_chunks(cp: int, device: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that `device` holds: one early, one late."""
    return device, 2 * cp - 1 - device


def zigzag_layout(cp: int) -> Callable[[np.ndarray], np.ndarray]:
    """A `sequence_layout` for the DataIterator: permute the last axis so that the contiguous cp
    split of the result gives device i the chunks `zigzag_chunks(cp, i)` (the identity when cp=1)."""
    def layout(x: np.ndarray) -> np.ndarray:
        t = x.shape[-1]
        if cp == 1:
            return x
        if t % (2 * cp):
            raise ConfigError(f"train.seq_len={t} is not divisible by 2*mesh.cp = {2 * cp}; the zigzag "
                              f"context-parallel layout cuts the sequence into 2*cp equal chunks.")
        chunks = np.arange(t).reshape(2 * cp, t // (2 * cp))
        order = np.concatenate([chunks[c] for i in range(cp) for c in zigzag_chunks(cp, i)])
        return x[..., order]
    return layout


def zigzag_pairs(i: Any, j: Any, first: bool) -> list[tuple[Any, Any, bool]]:
    """(query half, key half, causal) pairs device i folds in when it holds device j's K/V.

    Works on Python ints (for `zigzag_schedule`) and on traced ints (inside the ring), so the
    listing the tests check is the schedule the ring runs.
    """
    if first:  # j == i: the own block, diagonal pairs with a causal mask inside
        return [(1, 0, False), (0, 0, True), (1, 1, True)]
    h = (j > i) * 1  # 0: (early, early) when the block comes from a lower rank, 1: (late, late)
    return [(1, 0, False), (h, h, False)]


def zigzag_schedule(cp: int) -> list[list[list[tuple[int, int]]]]:
    """schedule[device][step]: the (query chunk, key chunk) pairs computed, as global chunk ids."""
    return [[[(zigzag_chunks(cp, i)[qh], zigzag_chunks(cp, (i - s) % cp)[kh])
              for qh, kh, _ in zigzag_pairs(i, (i - s) % cp, s == 0)]
             for s in range(cp)] for i in range(cp)]
