"""Ring collectives written by hand with `lax.ppermute` alone, so the algorithm NCCL runs on a ring is visible.
`ring_*` and `bucketed_all_reduce` run inside a shard_map over one axis; `all_reduce` & co. take a stacked global array
(row i: member i's value) and run the shard_map themselves; `impl='xla'` runs XLA's own collective: the tests'
reference and the benchmark's baseline. Sums accumulate in the array's dtype, like NCCL."""
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

_COMBINE: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "mean": jnp.add}


def check_op(op: str, dtype: Any) -> None:
    """Raise ConfigError for an unknown reduction or 'mean' of integers (every rounding rule surprises someone)."""
    if op not in _COMBINE:
        raise ConfigError(f"unknown op {op!r}; choose sum, max, min or mean.")
    if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
        raise ConfigError(f"op 'mean' needs a floating-point array, got {jnp.dtype(dtype).name}; "
                          "use op='sum' and divide with the rounding you want.")


def _axis(axis_name: str) -> tuple[int, jax.Array]:
    try:
        return lax.axis_size(axis_name), lax.axis_index(axis_name)
    except NameError as e:
        raise ConfigError(f"axis {axis_name!r} is not bound here; call ring collectives inside a "
                          "jax.shard_map over a mesh that has that axis.") from e


def _to_right(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _row(x: jax.Array, k: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(x, k, axis=0, keepdims=False)


def _as_chunks(x: jax.Array, n: int) -> jax.Array:
    flat = x.reshape(-1)
    width = -(-flat.size // n)
    return jnp.pad(flat, (0, n * width - flat.size)).reshape(n, width)


def ring_reduce_scatter(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    """`lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`, rows zero-padded to a multiple of n."""
    check_op(op, x.dtype)
    if x.ndim == 0:
        raise ConfigError("reduce-scatter splits dimension 0, so x needs at least one dimension; "
                          "reshape it to (1,) or use ring_all_reduce.")
    n, i = _axis(axis_name)
    k = -(-x.shape[0] // n)
    x = jnp.pad(x, [(0, n * k - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    chunks = x.reshape(n, k, *x.shape[1:])
    combine = _COMBINE[op]
    # Starting at chunk i-1 (not i) leaves chunk i fully reduced on device i after n-1 steps.
    acc = _row(chunks, (i - 1) % n)
    for s in range(n - 1):
        acc = combine(lax.ppermute(acc, axis_name, _to_right(n)), _row(chunks, (i - 2 - s) % n))
    return acc / n if op == "mean" else acc


def ring_all_gather(x: jax.Array, axis_name: str, tiled: bool = False) -> jax.Array:
    """`lax.all_gather(x, axis_name, tiled=tiled)`: each step forwards the block received last."""
    if tiled and x.ndim == 0:
        raise ConfigError("a tiled all-gather concatenates along dimension 0, so x needs at least "
                          "one dimension; use tiled=False.")
    n, i = _axis(axis_name)
    out = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, i, axis=0)
    block = x
    for s in range(n - 1):
        block = lax.ppermute(block, axis_name, _to_right(n))
        out = lax.dynamic_update_index_in_dim(out, block, (i - 1 - s) % n, axis=0)
    return out.reshape(n * x.shape[0], *x.shape[1:]) if tiled else out


def ring_all_reduce(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    """`lax.psum` & co. as a reduce-scatter then an all-gather of the flattened buffer."""
    check_op(op, x.dtype)
    n, _ = _axis(axis_name)
    if n == 1 or x.size == 0:
        return x
    mine = ring_reduce_scatter(_as_chunks(x, n), axis_name, op)
    flat = ring_all_gather(mine, axis_name, tiled=True).reshape(-1)
    return flat[:x.size].reshape(x.shape)


def ring_broadcast(x: jax.Array, axis_name: str, root: int = 0) -> jax.Array:
    """Every device gets the root's x, in n chunks pipelined down the chain: 2(n-1) ticks of B/n bytes
    instead of n-1 of B (SPMD: every device sends every tick, useful or not)."""
    n, i = _axis(axis_name)
    if not 0 <= root < n:
        raise ConfigError(f"root={root} is not a member of axis {axis_name!r} (size {n}); "
                          f"choose 0 <= root < {n}.")
    if n == 1 or x.size == 0:
        return x
    chunks = _as_chunks(x, n)
    pos = (i - root) % n
    chain = [((root + p) % n, (root + p + 1) % n) for p in range(n - 1)]
    received, last = [], chunks[0]
    for t in range(2 * n - 2):
        last = lax.ppermute(jnp.where(pos == 0, chunks[min(t, n - 1)], last), axis_name, chain)
        received.append(last)
    # Chunk k reaches the device at place pos at tick pos-1+k: its chunks are n consecutive ticks.
    mine = lax.dynamic_slice_in_dim(jnp.stack(received), jnp.maximum(pos - 1, 0), n, axis=0)
    chunks = jnp.where(pos == 0, chunks, mine)
    return chunks.reshape(-1)[:x.size].reshape(x.shape)


def bucketed_all_reduce(tree: Any, axis_name: str, op: Op = "sum",
                        bucket_bytes: int | None = None) -> Any:
    """One ring all-reduce per bucket of leaves (by dtype, up to `bucket_bytes`): latency paid per bucket (DDP's)."""
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


def _xla_all_reduce(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin, "mean": lax.pmean}[op](x, axis_name)


def _xla_reduce_scatter(x: jax.Array, axis_name: str, op: Op = "sum") -> jax.Array:
    n, i = _axis(axis_name)
    k = -(-x.shape[0] // n)
    x = jnp.pad(x, [(0, n * k - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    if op in ("sum", "mean"):
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


def all_reduce(x: jax.Array, mesh: Mesh, axis: str, op: Op = "sum", *, impl: Impl = "ring") -> jax.Array:
    """The reduction in every row."""
    return _run("all_reduce", x, mesh, axis, impl, op=op)


def reduce_scatter(x: jax.Array, mesh: Mesh, axis: str, op: Op = "sum", *,
                   impl: Impl = "ring") -> jax.Array:
    """Row i: member i's block of the reduction."""
    return _run("reduce_scatter", x, mesh, axis, impl, op=op)


def all_gather(x: jax.Array, mesh: Mesh, axis: str, *, tiled: bool = False, impl: Impl = "ring") -> jax.Array:
    """Every row holds all of x."""
    return _run("all_gather", x, mesh, axis, impl, tiled=tiled)


def broadcast(x: jax.Array, mesh: Mesh, axis: str, root: int = 0, *, impl: Impl = "ring") -> jax.Array:
    """Every row is x[root]."""
    return _run("broadcast", x, mesh, axis, impl, root=root)


def collective_fn(kind: str, mesh: Mesh, axis: str, impl: Impl = "ring", **options: Any) -> Callable:
    """The jitted collective behind the wrappers, for timing; its input placed by `NamedSharding(mesh, P(axis))`."""
    if axis not in mesh.axis_names:
        raise ConfigError(f"axis {axis!r} is not in the mesh; valid axes: {', '.join(mesh.axis_names)}.")
    if impl not in _BODIES:
        raise ConfigError(f"unknown impl {impl!r}; choose ring or xla.")
    if kind not in _BODIES[impl]:
        raise ConfigError(f"unknown collective {kind!r}; choose {', '.join(_BODIES[impl])}.")
    return _compiled(kind, mesh, axis, impl, tuple(sorted(options.items())))


def _run(kind: str, x: jax.Array, mesh: Mesh, axis: str, impl: Impl, **options: Any) -> jax.Array:
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
    per_member = lambda xs: body(xs[0], axis)[None]
    return jax.jit(jax.shard_map(per_member, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
