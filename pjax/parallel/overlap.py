"""Keeping an early collective apart from a step's late ones, so that it can overlap the step's compute.

XLA:GPU combines all-reduces that do not depend on each other into one (up to
`xla_gpu_all_reduce_combine_threshold_bytes`). Streaming DiLoCo's landing step reduces a fragment that was
ready before the step began, beside an inner step whose loss, gradient norm and learning rate are reduced over dp
at its end; combined with those, the fragment's reduction waits for the whole inner step. Inside `after(anchor)`,
with `anchor` a scalar computed from every reduced fragment leaf, each of the inner step's scalar reductions
first waits for `anchor` (`waits`), so none can join the fragment's, and XLA's latency-hiding scheduler is free to
start the fragment's all-reduces before the inner step's loops (tests/test_gpu_target.py reads the schedule).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp

from mesh.scoped import scoped

_ANCHOR: contextvars.ContextVar = contextvars.ContextVar("anchor", default=None)


def anchor_of(tree: Any) -> jax.Array:
    """A scalar that depends on every leaf of `tree` (one element of each)."""
    return sum(leaf.ravel()[0].astype(jnp.float32) for leaf in jax.tree.leaves(tree))


def after(anchor: jax.Array) -> contextlib.AbstractContextManager[None]:
    """Inside (traced in the block), `waits` makes its operand depend on `anchor`."""
    return scoped(_ANCHOR, anchor)


def waits(x: jax.Array) -> jax.Array:
    """`x`, computed after the anchor of the enclosing `after` (unchanged outside one). The dependency is an
    addition of 0 * anchor, which XLA does not fold (0 * x is not 0 for every float), and which keeps x exactly
    where the anchor is finite."""
    anchor = _ANCHOR.get()
    return x if anchor is None else x + (0.0 * anchor).astype(x.dtype)
