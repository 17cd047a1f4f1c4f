"""Sums within groups of consecutive dp replicas (DiLoCo's `train.diloco_groups`), inside a shard_map manual over dp.

`lax.psum` in a shard_map sums over a whole mesh axis (it takes no `axis_index_groups`: NotImplementedError in
jax 0.10.2), so a group of k = dp / groups replicas reduces its gradients on a ring of its own: a reduce-scatter
then an all-gather of k chunks, each step one `lax.ppermute` to the next replica of the same group, 2(k-1)/k of
the gradient's bytes per replica, as NCCL's ring. Each chunk is summed once, on one replica, and copied to the
others, so every replica of a group ends with the same bits, and its parameters stay identical."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mesh.mesh import DP


def group_sum(tree: Any, size: int) -> Any:
    """Every leaf of `tree` summed over its group of `size` consecutive dp replicas (all of one group alike)."""
    if size == 1:
        return tree
    return jax.tree.map(lambda x: _ring_sum(x, size), tree)


def _ring_sum(x: jax.Array, size: int) -> jax.Array:
    replicas = lax.axis_size(DP)
    me = lax.axis_index(DP) % size
    to_next = [(i, i - i % size + (i % size + 1) % size) for i in range(replicas)]
    flat = x.reshape(-1)
    width = -(-flat.size // size)
    chunks = jnp.pad(flat, (0, size * width - flat.size)).reshape(size, width)
    row = lambda k: lax.dynamic_index_in_dim(chunks, k % size, keepdims=False)  # noqa: E731
    # Reduce-scatter: starting from chunk me-1, after size-1 steps this replica holds chunk me summed.
    acc = row(me - 1)
    for s in range(size - 1):
        acc = lax.ppermute(acc, DP, to_next) + row(me - 2 - s)
    # All-gather: pass the summed chunks on round the group.
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(chunks), acc, me, axis=0)
    for s in range(size - 1):
        acc = lax.ppermute(acc, DP, to_next)
        out = lax.dynamic_update_index_in_dim(out, acc, (me - 1 - s) % size, axis=0)
    return out.reshape(-1)[:flat.size].reshape(x.shape)
