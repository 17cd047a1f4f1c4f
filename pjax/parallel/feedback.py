"""Error-feedback state for `train.grad_compression` and the compressed sum of one gradient leaf.

The state is {'error': one fp32 residual per parameter and data replica, [dp*cp, *shape], and, for PowerSGD,
'q': each matrix's warm-start Q per data replica and tp block, [dp*cp, tp, *layers, cols, rank]; with streaming
DiLoCo's P fragments, the embedding's and the head's once per fragment, [dp*cp, tp, P, cols, rank], since each
fragment is every P-th row of them, while a layer's fragment holds whole layers and keeps their Q}. Expert weights
(their gradients never cross dp) and PowerSGD's vectors (summed exactly) keep [dp*cp, 1] placeholders (Orbax
saves no empty array). The leading axis is split over the data axes: in the data shard_map, a device's own row."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh import rules
from mesh.mesh import CP, PP, TP
from mesh.rules import logical_to_spec, rows_axes
from models import llama
from models.config import LlamaConfig
from pjax.parallel import powersgd
from pjax.parallel.compression import compressed_sum, compressed_sum_scatter

_is_names = lambda x: isinstance(x, tuple)  # noqa: E731


def _is_expert(names: tuple) -> bool:
    return "experts" in names


def has_q(names: tuple) -> bool:
    """Whether PowerSGD keeps a warm-start Q for this parameter (a dense matrix)."""
    return not _is_expert(names) and powersgd.split(names) is not None


def shardings(mesh: Mesh, axes: tuple[str, ...], cfg: LlamaConfig, param_shardings: Any, mode: str
              ) -> dict[str, Any]:
    """NamedShardings of the state over the data `axes`: the error as the parameter behind its replica axis, Q
    over the tp blocks (and its layers over pp, as the parameter's)."""
    names = llama.param_logical_axes(cfg)
    error = jax.tree.map(lambda n, s: NamedSharding(mesh, P(axes) if _is_expert(n) else P(axes, *s.spec)),
                         names, param_shardings, is_leaf=_is_names)
    if mode != "powersgd":
        return {"error": error}
    q = jax.tree.map(lambda n, s: NamedSharding(mesh, P(axes, TP, *s.spec[:1]) if n[0] == "layers" else P(axes, TP))
                     if has_q(n) else NamedSharding(mesh, P(axes)), names, param_shardings, is_leaf=_is_names)
    return {"error": error, "q": q}


def zeros(params: Any, mesh: Mesh, axes: tuple[str, ...], cfg: LlamaConfig, mode: str, rank: int,
          fragments: int = 1) -> dict[str, Any]:
    """The state at step 0 (traced under a jit whose out_shardings are `shardings`): zero residuals, Q drawn
    from a fixed key per parameter, the same on every replica (and, with streaming DiLoCo's `fragments`, the same
    for each fragment)."""
    n = math.prod(mesh.shape[a] for a in axes)
    tp = mesh.shape[TP]
    names = llama.param_logical_axes(cfg)
    error = jax.tree.map(lambda nm, p: jnp.zeros((n, 1) if _is_expert(nm) else (n, *p.shape), jnp.float32),
                         names, params, is_leaf=_is_names)
    if mode != "powersgd":
        return {"error": error}
    flat, treedef = jax.tree.flatten(params)
    flat_names = jax.tree.leaves(names, is_leaf=_is_names)
    qs = []
    for i, (nm, p) in enumerate(zip(flat_names, flat)):
        if not has_q(nm):
            qs.append(jnp.zeros((n, 1), jnp.float32))
            continue
        local = tuple(d // tp if e == TP else d for d, e in zip(p.shape, logical_to_spec(nm)))
        per_fragment = fragments > 1 and nm[0] != "layers"  # a fragment: every P-th of its rows
        if per_fragment:
            local = (local[0] // fragments, *local[1:])
        q = powersgd.initial_q(jax.random.fold_in(jax.random.key(0x5EED), i), powersgd.q_shape(local, nm, rank))
        qs.append(jnp.broadcast_to(q, (n, tp, *(fragments,) * per_fragment, *q.shape)))
    return {"error": error, "q": jax.tree.unflatten(treedef, qs)}


def pipelined_specs(cfg: LlamaConfig, data: tuple[str, ...], state: dict[str, Any]) -> dict[str, Any]:
    """The state's specs in the pipeline's shard_map (manual over pp and the data axes)."""
    names = llama.param_logical_axes(cfg)
    layers = lambda n: (PP,) if n[0] == "layers" else ()  # noqa: E731
    out = {"error": jax.tree.map(lambda n: P(data) if _is_expert(n) else P(data, *layers(n)), names,
                                 is_leaf=_is_names)}
    if "q" in state:
        out["q"] = jax.tree.map(lambda n: P(data, None, *layers(n)) if has_q(n) else P(data), names,
                                is_leaf=_is_names)
    return out


def compresses(names: tuple[str | None, ...], mode: str) -> bool:
    """Whether `mode` compresses this dense weight's gradient (PowerSGD sums vectors exactly)."""
    return mode != "powersgd" or has_q(names)


def reduce_leaf(g: jax.Array, error: jax.Array, q: jax.Array | None, names: tuple[str | None, ...],
                axes: tuple[str, ...], split_dp: bool, mode: str) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One dense gradient's compressed sum over the data `axes` (ZeRO-1: this device's dp slice of it), its new
    residual and Q, per tp block: a flatten of a tp-split gradient would gather it."""
    tp_only = P(*(TP if entry == TP else None for entry in logical_to_spec(names)))
    r_spec = P(None, *tp_only)
    split_dp = split_dp and "embed" in names  # a weight ZeRO keeps whole is reduced whole (`data_parallel.zero_axis`)
    if mode == "powersgd":
        def low_rank(g, r, q):
            total, err, q_next = powersgd.powersgd_sum(g, r[0], q[0, 0], axes, names)
            return (_my_dp_slice(total, names.index("embed"), axes) if split_dp else total), err[None], q_next[None, None]

        return rules.per_device(low_rank, (tp_only, r_spec, P(None, TP)), (tp_only, r_spec, P(None, TP)))(g, error, q)

    def payload(g, r):
        if split_dp:
            out, err = compressed_sum_scatter(g, r[0], rows_axes(axes), names.index("embed"), mode)
            out = lax.psum(out, CP) if CP in axes else out
        else:
            out, err = compressed_sum(g, r[0], axes, mode)
        return out, err[None]

    out, err = rules.per_device(payload, (tp_only, r_spec), (tp_only, r_spec))(g, error)
    return out, err, q


def _my_dp_slice(x: jax.Array, dimension: int, axes: tuple[str, ...]) -> jax.Array:
    """This dp device's tile of `x` along `dimension` (what a tiled psum_scatter over dp x ep would leave it)."""
    rows = rows_axes(axes)
    size = x.shape[dimension] // lax.axis_size(rows)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(rows) * size, size, dimension)
