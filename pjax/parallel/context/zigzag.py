"""The zigzag layout every context-parallel strategy takes (ARCHITECTURE.md, "Zigzag ring attention")."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mesh.errors import ConfigError


def zigzag_chunks(cp: int, device: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that `device` holds: one early, one late."""
    return device, 2 * cp - 1 - device


def zigzag_layout(cp: int) -> Callable[[np.ndarray], np.ndarray]:
    """A DataIterator `sequence_layout`: the contiguous cp split of its result gives device i `zigzag_chunks(cp, i)`."""
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
    """(query half, key half, causal) pairs device i folds with device j's K/V (0 early, 1 late): (late, early) and
    (h, h), h = j > i, or with j == i both diagonals masked. On Python or traced ints, so tests check the ring's own."""
    if first:  # j == i
        return [(1, 0, False), (0, 0, True), (1, 1, True)]
    h = (j > i) * 1
    return [(1, 0, False), (h, h, False)]


def zigzag_schedule(cp: int) -> list[list[list[tuple[int, int]]]]:
    """schedule[device][step]: the (query chunk, key chunk) pairs computed, as global chunk ids."""
    return [[[(zigzag_chunks(cp, i)[qh], zigzag_chunks(cp, (i - s) % cp)[kh])
              for qh, kh, _ in zigzag_pairs(i, (i - s) % cp, s == 0)]
             for s in range(cp)] for i in range(cp)]
