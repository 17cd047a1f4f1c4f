"""One check for two programs that compute the same values but may order their fp32 sums differently."""
from __future__ import annotations

import numpy as np


def assert_close_but_a_few(actual, desired, rtol: float, atol: float, bound: float, share: float = 1e-4) -> None:
    """`actual` equals `desired` to rtol/atol, but for at most `share` of its entries, each at most `bound` away.

    XLA may order a sum's additions in one program otherwise than in another: the tests' loop emitters do
    (tests/conftest.py), and some CPUs' vector code does (benchmarks/log/suite.md). Almost every value then moves
    by a last bit, but one on an int8 rounding boundary (`bound`: one quantum, absmax / 127) or one whose gradient
    nearly cancels, which AdamW divides by its root mean square, moves by more."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    off = ~np.isclose(actual, desired, rtol=rtol, atol=atol)
    assert off.mean() <= share, f"{off.sum()} of {off.size} entries differ"
    gap = np.abs(actual - desired)[off]
    assert np.all(gap <= bound), f"an entry is {gap.max()} away, more than {bound}"
