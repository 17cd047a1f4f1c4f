"""Where the dp replicas train models of their own (DiLoCo's groups, meta-learning's tasks): inside
`replica_groups(size)`, a statistic of a tensor split over dp is taken over its group of `size` consecutive dp
replicas only, never over all of dp. An MoE layer's router statistics read it (`models/moe.py`), whose balancing
loss would otherwise couple the groups through its gradient; fp8's amax takes none over dp at all.

`lax.psum` takes no `axis_index_groups` in a shard_map (jax 0.10.2), so a group's reduction is an
all-gather over dp of the (small) statistic and a reduction of the group's slice of it: every replica of a group
ends with the same value, and its transpose hands each replica its group's cotangents."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mesh.mesh import DP
from mesh.scoped import scoped

# The replicas in a group, consecutive along dp, that hold one model. None: all of them hold one.
_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar("replica_group", default=None)


def replica_groups(size: int) -> contextlib.AbstractContextManager[None]:
    """Inside, a statistic over dp is one over each group of `size` replicas (traced in the block)."""
    return scoped(_GROUP, size)


def psum(tree: Any, axes: tuple[str, ...]) -> Any:
    """`lax.psum(tree, axes)`, over dp within the replica group only."""
    group = _GROUP.get()
    if group is None or DP not in axes:
        return lax.psum(tree, axes) if axes else tree
    rest = tuple(ax for ax in axes if ax != DP)
    tree = lax.psum(tree, rest) if rest else tree
    if group == 1:
        return tree

    def in_group(x: jax.Array) -> jax.Array:
        every = lax.all_gather(x, DP)  # one per replica: the group's are `group` consecutive ones
        return jnp.sum(lax.dynamic_slice_in_dim(every, lax.axis_index(DP) // group * group, group), axis=0)
    return jax.tree.map(in_group, tree)
