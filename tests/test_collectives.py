"""The hand-written ring collectives equal XLA's (psum, pmax, pmin, pmean, psum_scatter, all_gather).

Each test traces all its shapes and dtypes into ONE shard_map program (ring and lax side by side),
so a parametrization costs one compile, not one per array: the file stays fast on 2 cores.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import CP, DP, PP, TP, MeshConfig, make_mesh
from pjax.parallel import collectives as C

SIZES = (2, 3, 4, 5, 8)  # axis sizes, odd ones included: the chunking must not assume powers of 2
SHAPES = ((7, 3), (13,), (1,), ())  # ragged: nothing here divides evenly by 2, 3, 4, 5 or 8
# sum and max on every size; min mirrors max and mean is sum / n, so two sizes cover them.
GRID = [(n, op) for n in SIZES for op in ("sum", "max")] + [(n, op) for n in (3, 8) for op in ("min", "mean")]
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=0.125)}


@functools.lru_cache(maxsize=None)
def _mesh(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), (DP,), devices=jax.devices()[:n])


def _inputs(n: int, shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """One value per member, stacked: [n, *shape]; ints span negatives so max/min are not trivial."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(-1000, 1000, (n, *shape)).astype(dtype)
    return rng.standard_normal((n, *shape)).astype(dtype)


def _per_member(body: Callable, n: int, xs: list[np.ndarray]) -> Any:
    """Run body(*local values) on every member of a 1-D mesh of n devices; stacked numpy results."""
    mesh = _mesh(n)
    stacked = lambda *a: jax.tree.map(lambda y: y[None], body(*[v[0] for v in a]))
    f = jax.jit(jax.shard_map(stacked, mesh=mesh, in_specs=(P(DP),) * len(xs), out_specs=P(DP)))
    return jax.tree.map(np.asarray, f(*[jax.device_put(x, NamedSharding(mesh, P(DP))) for x in xs]))


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise for ints (and max/min), to rounding for float sums."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype)
    if jnp.issubdtype(got.dtype, jnp.integer):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), **TOL[got.dtype.type])


def _cases(op: str) -> list[tuple[tuple[int, ...], Any]]:
    """Every ragged shape in ints (exact), plus floats for rounding; mean is for floats only."""
    if op == "mean":
        return [(shape, jnp.float32) for shape in SHAPES] + [((9, 2), jnp.bfloat16)]
    return [(shape, jnp.int32) for shape in SHAPES] + [((7, 3), jnp.float32), ((9, 2), jnp.bfloat16)]


@pytest.mark.parametrize("n, op", GRID)
def test_ring_all_reduce_equals_lax_and_is_identical_on_every_member(n: int, op: str) -> None:
    xs = [_inputs(n, shape, dtype, seed) for seed, (shape, dtype) in enumerate(_cases(op))]
    ring, ref = _per_member(lambda *v: ([C.ring_all_reduce(x, DP, op) for x in v],
                                        [C._xla_all_reduce(x, DP, op) for x in v]), n, xs)
    for got, want in zip(ring, ref):
        _assert_same(got, want)
        # Bitwise equal across members, floats too: DP replicas must not drift apart.
        assert (got == got[:1]).all()


@pytest.mark.parametrize("n, op", GRID)
def test_ring_reduce_scatter_equals_psum_scatter_and_pads_ragged_rows(n: int, op: str) -> None:
    even = [(n * 3, 2), (n,)]  # lax.psum_scatter's own domain
    ragged = [(13,), (7, 3)] if op == "mean" else [(13,), (7, 3), (1,)]
    dtype = jnp.float32 if op == "mean" else jnp.int32
    xs = [_inputs(n, shape, dtype, seed) for seed, shape in enumerate(even + ragged)]
    xs.append(_inputs(n, (n * 2, 3), jnp.float32, 99))
    ring, ref = _per_member(lambda *v: ([C.ring_reduce_scatter(x, DP, op) for x in v],
                                        [C._xla_reduce_scatter(x, DP, op) for x in v]), n, xs)
    reduce = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}[op]
    for x, got, want in zip(xs, ring, ref):
        _assert_same(got, want)
        # Rows of the members' blocks, in member order, are the whole reduction plus zero padding.
        whole = got.reshape(-1, *x.shape[2:])
        rows = x.shape[1]
        np.testing.assert_allclose(whole[:rows], reduce(x.astype(np.float64), axis=0), rtol=1e-5, atol=1e-5)
        assert (whole[rows:] == 0).all()


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_gather_equals_lax_all_gather_for_any_shape_and_dtype(n: int) -> None:
    cases = [(shape, jnp.int32) for shape in SHAPES] + [((5,), jnp.float32), ((3, 2), jnp.bfloat16)]
    xs = [_inputs(n, shape, dtype, seed) for seed, (shape, dtype) in enumerate(cases)]
    tiled = [x.ndim > 1 for x in xs]  # a 0-d value can only be stacked, not concatenated

    def body(*v):
        ring = [C.ring_all_gather(x, DP, tiled=t) for x, t in zip(v, tiled)]
        return ring, [lax.all_gather(x, DP, tiled=t) for x, t in zip(v, tiled)]

    ring, ref = _per_member(body, n, xs)
    for x, t, got, want in zip(xs, tiled, ring, ref):
        np.testing.assert_array_equal(got, want)  # gathering moves bits: exact for every dtype
        np.testing.assert_array_equal(got[0], x.reshape(-1, *x.shape[2:]) if t else x)


@pytest.mark.parametrize("n", SIZES)
def test_ring_broadcast_gives_every_member_the_roots_value(n: int) -> None:
    roots = (0, n - 1)  # the chain starts at the root and wraps round the end of the axis
    xs = [_inputs(n, (7, 3), jnp.int32, 0), _inputs(n, (), jnp.float32, 1)]
    out = _per_member(lambda *v: [[C.ring_broadcast(x, DP, root=r) for x in v] for r in roots], n, xs)
    for r, per_root in zip(roots, out):
        for x, got in zip(xs, per_root):
            np.testing.assert_array_equal(got, np.broadcast_to(x[r], got.shape))


@pytest.mark.parametrize("bucket_bytes", [None, 64])
@pytest.mark.parametrize("n", [3, 8])
def test_bucketed_all_reduce_equals_psum_per_leaf(n: int, bucket_bytes: int | None) -> None:
    shapes = {"w": (7, 3), "b": (5,), "s": (), "big": (40,)}
    tree = {k: _inputs(n, s, jnp.float32, i) for i, (k, s) in enumerate(shapes.items())}
    tree["steps"] = _inputs(n, (3,), jnp.int32, 9)  # a second dtype gets its own bucket
    leaves, treedef = jax.tree.flatten(tree)

    def body(*v):
        local = jax.tree.unflatten(treedef, v)
        return C.bucketed_all_reduce(local, DP, "sum", bucket_bytes), jax.tree.map(lambda x: lax.psum(x, DP), local)

    got, want = _per_member(body, n, leaves)
    jax.tree.map(_assert_same, got, want)


def test_buckets_group_by_dtype_and_respect_the_cap() -> None:
    leaves = [jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.zeros(4), jnp.zeros(8)]  # 16, 16, 16, 32 bytes
    assert C._buckets(leaves, None) == [[0, 2, 3], [1]]
    assert C._buckets(leaves, 32) == [[0, 2], [3], [1]]


@pytest.mark.parametrize("axis", [DP, PP, CP, TP])
def test_wrappers_on_the_4d_mesh_match_xla_over_each_axis(axis: str) -> None:
    mesh = make_mesh(MeshConfig(dp=2, pp=1, cp=2, tp=2))
    n = mesh.shape[axis]
    x = _inputs(n, (5, 3), jnp.int32)
    for fn in (C.all_reduce, C.reduce_scatter):
        np.testing.assert_array_equal(fn(x, mesh, axis, "max"), fn(x, mesh, axis, "max", impl="xla"))
    np.testing.assert_array_equal(C.all_gather(x, mesh, axis), C.all_gather(x, mesh, axis, impl="xla"))
    np.testing.assert_array_equal(C.broadcast(x, mesh, axis, root=n - 1), np.broadcast_to(x[n - 1], x.shape))


@pytest.mark.parametrize("call, message", [
    (lambda m, x: C.all_reduce(x, m, DP, "prod"), "unknown op 'prod'; choose sum, max, min or mean"),
    (lambda m, x: C.all_reduce(x, m, "xx"), "axis 'xx' is not in the mesh; valid axes: dp, pp, cp, tp"),
    (lambda m, x: C.reduce_scatter(x, m, TP, "mean"), "op 'mean' needs a floating-point array, got int32"),
    (lambda m, x: C.broadcast(x, m, DP, root=2), "root=2 is not a member of axis 'dp' (size 2)"),
    (lambda m, x: C.all_gather(x[:1], m, DP), "leading dimension 2; got shape (1, 3)"),
    (lambda m, x: C.all_reduce(x, m, DP, impl="nccl"), "unknown impl 'nccl'; choose ring or xla"),
])
def test_bad_input_gets_a_one_sentence_config_error(call: Callable, message: str) -> None:
    mesh = make_mesh(MeshConfig(dp=2, pp=1, cp=2, tp=2))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(mesh, np.zeros((2, 3), np.int32))


def test_ring_collective_outside_shard_map_names_the_unbound_axis() -> None:
    with pytest.raises(ConfigError, match="axis 'dp' is not bound here"):
        jax.jit(lambda x: C.ring_all_reduce(x, DP))(jnp.ones(3))
