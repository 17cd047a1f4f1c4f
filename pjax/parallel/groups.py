"""Sums within groups of consecutive dp replicas (DiLoCo's `train.diloco_groups`), inside a shard_map manual over dp.

`lax.psum` in a shard_map sums over a whole mesh axis (it takes no `axis_index_groups`: NotImplementedError in
jax 0.10.2), so a group of k = dp / groups replicas reduces its gradients on a ring of its own: a reduce-scatter
then an all-gather of k chunks, each step one `lax.ppermute` to the next replica of the same group, 2(k-1)/k of
the gradient's bytes per replica, as NCCL's ring. Each chunk is summed once, on one replica, and copied to the
others, so every replica of a group ends with the same bits, and its parameters stay identical. Under ZeRO
(`group_zero`) the halves run apart, on chunks of a parameter's 'embed' axis: `group_scatter`, `group_gather`."""
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


def group_scatter(x: jax.Array, size: int, axis: int) -> jax.Array:
    """The ring's first half: `x` summed over its group, this replica keeping chunk (replica % size) of `axis`."""
    return _reduce_scatter(_split(x, size, axis), size)


def group_gather(x: jax.Array, size: int, axis: int) -> jax.Array:
    """The ring's second half: the group's chunks of `axis` (this replica's is `x`), concatenated in order."""
    out = _all_gather(x, size)
    return jnp.moveaxis(out, 0, axis).reshape(*x.shape[:axis], size * x.shape[axis], *x.shape[axis + 1:])


def _split(x: jax.Array, size: int, axis: int) -> jax.Array:
    """[size, ...]: `x`'s `axis` cut into `size` consecutive chunks."""
    view = x.reshape(*x.shape[:axis], size, x.shape[axis] // size, *x.shape[axis + 1:])
    return jnp.moveaxis(view, axis, 0)


def _to_next(size: int) -> list[tuple[int, int]]:
    replicas = lax.axis_size(DP)
    return [(i, i - i % size + (i % size + 1) % size) for i in range(replicas)]


def _reduce_scatter(chunks: jax.Array, size: int) -> jax.Array:
    """Starting from chunk me-1, after size-1 steps on the ring this replica holds chunk me summed."""
    me, to_next = lax.axis_index(DP) % size, _to_next(size)
    row = lambda k: lax.dynamic_index_in_dim(chunks, k % size, keepdims=False)  # noqa: E731
    acc = row(me - 1)
    for s in range(size - 1):
        acc = lax.ppermute(acc, DP, to_next) + row(me - 2 - s)
    return acc


def _all_gather(acc: jax.Array, size: int) -> jax.Array:
    """[size, ...]: every replica's `acc` of the group, passed on round the ring."""
    me, to_next = lax.axis_index(DP) % size, _to_next(size)
    out = lax.dynamic_update_index_in_dim(jnp.zeros((size, *acc.shape), acc.dtype), acc, me, axis=0)
    for s in range(size - 1):
        acc = lax.ppermute(acc, DP, to_next)
        out = lax.dynamic_update_index_in_dim(out, acc, (me - 1 - s) % size, axis=0)
    return out


def _ring_sum(x: jax.Array, size: int) -> jax.Array:
    flat = x.reshape(-1)
    width = -(-flat.size // size)
    chunks = jnp.pad(flat, (0, size * width - flat.size)).reshape(size, width)
    return _all_gather(_reduce_scatter(chunks, size), size).reshape(-1)[:flat.size].reshape(x.shape)
