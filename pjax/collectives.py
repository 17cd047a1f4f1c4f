"""Ring collectives written by hand: all-reduce, reduce-scatter, all-gather, broadcast.

XLA has all of these built in (`lax.psum`, `lax.psum_scatter`, `lax.all_gather`). Here they are
spelled out with one primitive, `lax.ppermute` ("every device sends a buffer to its right-hand
neighbour"), so the algorithm NCCL runs on a ring is visible: no device ever talks to more than
two others, and every link carries the same amount, which is why the ring is bandwidth-optimal.

Two layers:
* `ring_all_reduce`, `ring_reduce_scatter`, `ring_all_gather`, `ring_broadcast` and
  `bucketed_all_reduce` run INSIDE a `jax.shard_map` body, over one named mesh axis.
* `all_reduce`, `reduce_scatter`, `all_gather` and `broadcast` take a *stacked* global array
  (row i is the value held by member i of the axis), run the shard_map for you and return the
  per-member results stacked the same way. `impl='xla'` runs XLA's native collective instead:
  the reference for the tests and the baseline for `benchmarks/collectives.py`.

Reductions: 'sum', 'max', 'min' and 'mean'. 'mean' is the sum divided by n and is allowed for
floating-point arrays only: for integers every rounding rule (floor, truncate, promote to float)
surprises someone, so choose one yourself (op='sum', then divide). Sums accumulate in the
array's own dtype, like NCCL; bf16 therefore differs from `psum` by rounding (the order differs).

Cost, for n devices and a buffer of B bytes per device (what `benchmarks/collectives.py` checks):
all-reduce sends 2(n-1)/n * B per device in 2(n-1) steps; reduce-scatter (n-1)/n * B in n-1;
all-gather (n-1) * B_in = (n-1)/n * B_out in n-1; broadcast 2(n-1)/n * B in 2(n-1) (pipelined).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError

Op = Literal["sum", "max", "min", "mean"]
Impl = Literal["ring", "xla"]

# How two partial results combine; 'mean' sums and divides once at the end.
_COMBINE: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "mean": jnp.add}


def check_op(op: str, dtype: Any) -> None:
    """Raise ConfigError for an unknown reduction or for 'mean' of an integer array."""
    if op not in _COMBINE:
        raise ConfigError(f"unknown op {op!r}; choose sum, max, min or mean.")
    if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
        raise ConfigError(f"op 'mean' needs a floating-point array, got {jnp.dtype(dtype).name}; "
                          "use op='sum' and divide with the rounding you want.")


def _axis(axis_name: str) -> tuple[int, jax.Array]:
    """(size, this device's index) of a bound axis; a clear error when called outside shard_map."""
    try:
        return lax.axis_size(axis_name), lax.axis_index(axis_name)
    except NameError as e:
        raise ConfigError(f"axis {axis_name!r} is not bound here; call ring collectives inside a "
                          "jax.shard_map over a mesh that has that axis.") from e


def _to_right(n: int) -> list[tuple[int, int]]:
    """The ring: device i sends to i+1, the last one wraps round to 0."""
    return [(i, (i + 1) % n) for i in range(n)]


def _row(x: jax.Array, k: jax.Array) -> jax.Array:
    """x[k] for a traced k: which chunk a device handles depends on its position in the ring."""
    return lax.dynamic_index_in_dim(x, k, axis=0, keepdims=False)


def _as_chunks(x: jax.Array, n: int) -> jax.Array:
    """Flatten x, pad with zeros to a multiple of n and cut into n equal rows: [n, ceil(size/n)]."""
    flat = x.reshape(-1)
    width = -(-flat.size // n)
    return jnp.pad(flat, (0, n * width - flat.size)).reshape(n, width)


# ---------------------------------------------------------------------------------------------
# Layer 1: inside a shard_map body
# ---------------------------------------------------------------------------------------------

def ring_reduce_scatter(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    """Reduce x over the axis and keep this device's block of rows (dimension 0 is split).

    Like `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`: device i gets rows
    [i*k, (i+1)*k) with k = ceil(rows/n). When n does not divide the rows, dimension 0 is padded
    with zeros first, so the padding rows of the last devices hold op(0, ..., 0) = 0.
    Sends (n-1)/n * B bytes per device in n-1 steps.
    """
    check_op(op, x.dtype)
    if x.ndim == 0:
        raise ConfigError("reduce-scatter splits dimension 0, so x needs at least one dimension; "
                          "reshape it to (1,) or use ring_all_reduce.")
    n, i = _axis(axis_name)
    k = -(-x.shape[0] // n)
    x = jnp.pad(x, [(0, n * k - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    chunks = x.reshape(n, k, *x.shape[1:])
    combine = _COMBINE[op]
    # Classic ring schedule: at step s device i passes on its partial sum of chunk (i-1-s) mod n
    # and folds its own copy of the chunk it receives, (i-2-s) mod n, into it. Starting at i-1
    # (not i) means the chunk that ends fully reduced on device i, after n-1 steps, is chunk i.
    acc = _row(chunks, (i - 1) % n)  # jnp's % is Python's: never negative
    for s in range(n - 1):
        acc = combine(lax.ppermute(acc, axis_name, _to_right(n)), _row(chunks, (i - 2 - s) % n))
    return acc / n if op == "mean" else acc


def ring_all_gather(x: jax.Array, axis_name: str, tiled: bool = False) -> jax.Array:
    """Every device's x on every device: [n, *x.shape], or concatenated along dim 0 if `tiled`.

    Like `lax.all_gather(x, axis_name, tiled=tiled)`. Each step every device forwards the block
    it received last, so after n-1 steps all blocks have gone round the ring.
    Sends (n-1) * B_in = (n-1)/n * B_out bytes per device in n-1 steps.
    """
    if tiled and x.ndim == 0:
        raise ConfigError("a tiled all-gather concatenates along dimension 0, so x needs at least "
                          "one dimension; use tiled=False.")
    n, i = _axis(axis_name)
    out = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, i, axis=0)
    block = x
    for s in range(n - 1):
        block = lax.ppermute(block, axis_name, _to_right(n))  # now holds device (i-1-s)'s block
        out = lax.dynamic_update_index_in_dim(out, block, (i - 1 - s) % n, axis=0)
    return out.reshape(n * x.shape[0], *x.shape[1:]) if tiled else out


def ring_all_reduce(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    """Reduce x (any shape) over the axis; every device gets the result. Like `lax.psum` & co.

    Reduce-scatter then all-gather over the flattened buffer, cut into n chunks (zero-padded
    when n does not divide the size). Sends 2(n-1)/n * B bytes per device in 2(n-1) steps --
    independent of n for large n, where a naive "everyone sends to everyone" costs (n-1) * B.
    """
    check_op(op, x.dtype)
    n, _ = _axis(axis_name)
    if n == 1 or x.size == 0:
        return x
    mine = ring_reduce_scatter(_as_chunks(x, n), axis_name, op)  # [1, width]: chunk i, reduced
    flat = ring_all_gather(mine, axis_name, tiled=True).reshape(-1)
    return flat[:x.size].reshape(x.shape)


def ring_broadcast(x: jax.Array, axis_name: str, root: int = 0) -> jax.Array:
    """Every device gets the root's x (the others' x is ignored). Pipelined along the ring.

    Sending all of x down the chain root -> root+1 -> ... would take n-1 steps of B bytes. Cut
    into n chunks instead, every link carries a different chunk at once: at tick t the device p
    places after the root forwards chunk t-p (the one it received the tick before), and the last
    chunk arrives after 2(n-1) ticks of B/n bytes. SPMD means every device in the chain sends
    every tick, useful or not: 2(n-1)/n * B bytes per device, B of them useful.
    """
    n, i = _axis(axis_name)
    if not 0 <= root < n:
        raise ConfigError(f"root={root} is not a member of axis {axis_name!r} (size {n}); "
                          f"choose 0 <= root < {n}.")
    if n == 1 or x.size == 0:
        return x
    chunks = _as_chunks(x, n)
    pos = (i - root) % n  # this device's place in the chain
    chain = [((root + p) % n, (root + p + 1) % n) for p in range(n - 1)]  # no link back to root
    received, last = [], chunks[0]
    for t in range(2 * n - 2):
        # The root feeds chunk t into the chain; every other device forwards what it got last tick.
        last = lax.ppermute(jnp.where(pos == 0, chunks[min(t, n - 1)], last), axis_name, chain)
        received.append(last)
    # Chunk k reaches the device at place pos at tick pos-1+k: its chunks are n consecutive ticks.
    mine = lax.dynamic_slice_in_dim(jnp.stack(received), jnp.maximum(pos - 1, 0), n, axis=0)
    chunks = jnp.where(pos == 0, chunks, mine)
    return chunks.reshape(-1)[:x.size].reshape(x.shape)


def bucketed_all_reduce(tree: Any, axis_name: str, op: Op = "sum",
                        bucket_bytes: int | None = None) -> Any:
    """All-reduce every leaf of a pytree with one ring all-reduce per bucket.

    Many small all-reduces pay the per-step latency 2(n-1) times each; flattening the leaves
    into one buffer pays it once (Picotron's "batch all-reduce", DDP's gradient buckets). Leaves
    are grouped by dtype, in order; `bucket_bytes` caps a bucket (None: one bucket per dtype).
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    for leaf in leaves:
        check_op(op, leaf.dtype)
    out: list[jax.Array | None] = [None] * len(leaves)
    for bucket in _buckets(leaves, bucket_bytes):
        buffer = jnp.concatenate([leaves[j].reshape(-1) for j in bucket])
        reduced = ring_all_reduce(buffer, axis_name, op)
        offsets = np.cumsum([leaves[j].size for j in bucket])[:-1]
        for j, piece in zip(bucket, jnp.split(reduced, offsets)):
            out[j] = piece.reshape(leaves[j].shape)
    return jax.tree.unflatten(treedef, out)


def _buckets(leaves: list[jax.Array], bucket_bytes: int | None) -> list[list[int]]:
    """Leaf indices grouped by dtype, in order, a new bucket started when one would pass the cap."""
    open_buckets: dict[Any, list[int]] = {}
    full: list[list[int]] = []
    for j, leaf in enumerate(leaves):
        bucket = open_buckets.setdefault(leaf.dtype, [])
        used = sum(leaves[b].nbytes for b in bucket)
        if bucket and bucket_bytes is not None and used + leaf.nbytes > bucket_bytes:
            full.append(bucket)
            bucket = open_buckets[leaf.dtype] = []
        bucket.append(j)
    return full + [b for b in open_buckets.values() if b]


# ---------------------------------------------------------------------------------------------
# XLA's native collectives with the same signatures: the reference and the benchmark baseline
# ---------------------------------------------------------------------------------------------

def _xla_all_reduce(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin, "mean": lax.pmean}[op](x, axis_name)


def _xla_reduce_scatter(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    n, i = _axis(axis_name)
    k = -(-x.shape[0] // n)
    x = jnp.pad(x, [(0, n * k - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    if op in ("sum", "mean"):  # lax has a reduce-scatter for sums only
        out = lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
        return out / n if op == "mean" else out
    return lax.dynamic_slice_in_dim(_xla_all_reduce(x, axis_name, op), i * k, k, axis=0)


def _xla_broadcast(x: jax.Array, axis_name: str, root: int = 0) -> jax.Array:
    return lax.all_gather(x, axis_name)[root]  # lax has no broadcast; exact, though n times the bytes


_BODIES: dict[str, dict[str, Callable[..., jax.Array]]] = {
    "ring": {"all_reduce": ring_all_reduce, "reduce_scatter": ring_reduce_scatter,
             "all_gather": ring_all_gather, "broadcast": ring_broadcast},
    "xla": {"all_reduce": _xla_all_reduce, "reduce_scatter": _xla_reduce_scatter,
            "all_gather": lambda x, axis_name, tiled=False: lax.all_gather(x, axis_name, tiled=tiled),
            "broadcast": _xla_broadcast},
}


# ---------------------------------------------------------------------------------------------
# Layer 2: stacked global arrays in, stacked results out
# ---------------------------------------------------------------------------------------------

def all_reduce(x: jax.Array, mesh: Mesh, axis: str, op: Op = "sum", *, impl: Impl = "ring") -> jax.Array:
    """x[i] is member i's value; returns [n, *x.shape[1:]] with the reduction in every row."""
    return _run("all_reduce", x, mesh, axis, impl, op=op)


def reduce_scatter(x: jax.Array, mesh: Mesh, axis: str, op: Op = "sum", *,
                   impl: Impl = "ring") -> jax.Array:
    """x[i] is member i's value; row i of the result is member i's block of the reduction
    (see `ring_reduce_scatter`); `.reshape(-1, *rest)[:x.shape[1]]` gives the whole reduction."""
    return _run("reduce_scatter", x, mesh, axis, impl, op=op)


def all_gather(x: jax.Array, mesh: Mesh, axis: str, *, tiled: bool = False, impl: Impl = "ring") -> jax.Array:
    """x[i] is member i's value; every row of the result holds all of them."""
    return _run("all_gather", x, mesh, axis, impl, tiled=tiled)


def broadcast(x: jax.Array, mesh: Mesh, axis: str, root: int = 0, *, impl: Impl = "ring") -> jax.Array:
    """x[i] is member i's value; every row of the result is x[root]."""
    return _run("broadcast", x, mesh, axis, impl, root=root)


def collective_fn(kind: str, mesh: Mesh, axis: str, impl: Impl = "ring", **options: Any) -> Callable:
    """The jitted stacked-array collective behind the wrappers, for callers that time it (the
    benchmark): `kind` is all_reduce, reduce_scatter, all_gather or broadcast; `options` its
    keywords (op, tiled, root). Its input must already be placed with `NamedSharding(mesh, P(axis))`."""
    if axis not in mesh.axis_names:
        raise ConfigError(f"axis {axis!r} is not in the mesh; valid axes: {', '.join(mesh.axis_names)}.")
    if impl not in _BODIES:
        raise ConfigError(f"unknown impl {impl!r}; choose ring or xla.")
    if kind not in _BODIES[impl]:
        raise ConfigError(f"unknown collective {kind!r}; choose {', '.join(_BODIES[impl])}.")
    return _compiled(kind, mesh, axis, impl, tuple(sorted(options.items())))


def _run(kind: str, x: jax.Array, mesh: Mesh, axis: str, impl: Impl, **options: Any) -> jax.Array:
    """Validate, then call the cached jitted shard_map for (kind, mesh, axis, impl, options)."""
    fn = collective_fn(kind, mesh, axis, impl, **options)
    x = jnp.asarray(x)
    n = mesh.shape[axis]
    if x.ndim == 0 or x.shape[0] != n:
        raise ConfigError(f"x must stack one value per member of axis {axis!r}, i.e. have leading "
                          f"dimension {n}; got shape {tuple(x.shape)}.")
    if "op" in options:
        check_op(options["op"], x.dtype)
    # Place row i on member i first: under Explicit axes shard_map refuses any other layout.
    return fn(jax.device_put(x, NamedSharding(mesh, P(axis))))


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, mesh: Mesh, axis: str, impl: str, options: tuple) -> Callable:
    body = functools.partial(_BODIES[impl][kind], **dict(options))
    # Members of the other mesh axes hold the same rows and run the same collective side by side,
    # like the tp groups of every dp replica all-reducing at once.
    per_member = lambda xs: body(xs[0], axis)[None]
    return jax.jit(jax.shard_map(per_member, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
