"""Data parallelism and ZeRO over `dp`: zero=1 splits the Adam moments by 'embed', zero=3 (FSDP) the parameters too;
when each reduces: ARCHITECTURE.md, "Gradients reduced once per step"."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax import lax

from mesh import rules
from mesh.mesh import CP, DP, PP, TP, current
from mesh.rules import logical_to_spec, param_rules
from models import llama
from models.config import LlamaConfig
from pjax.parallel.compression import compressed_sum, compressed_sum_scatter

_is_names = lambda x: isinstance(x, tuple)


def _shardings(mesh: Mesh, cfg: LlamaConfig, zero_sharded: bool) -> Any:
    """Every parameter's NamedSharding under the rules table; ZeRO leaves expert weights as they are."""
    pipelined = mesh.shape[PP] > 1
    rules, expert_rules = param_rules(zero_sharded, pipelined), param_rules(False, pipelined)
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, expert_rules if "experts" in names
                                                                          else rules)),
                        llama.param_logical_axes(cfg), is_leaf=_is_names)


def param_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """NamedShardings for the parameters: over dp only under ZeRO-3, the stacked layers over pp."""
    return _shardings(mesh, cfg, zero_sharded=zero >= 3)


def grad_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """Where gradients live: like the optimizer state, so ZeRO-1/3 reduce-scatter them."""
    return _shardings(mesh, cfg, zero_sharded=zero >= 1)


def opt_state_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int, optimizer: optax.GradientTransformation,
                        params_shape: Any) -> Any:
    """Optimizer-state shardings: parameter-shaped leaves follow `grad_shardings`, the rest replicated."""
    state_shape = jax.eval_shape(optimizer.init, params_shape)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, s: s, state_shape, grad_shardings(mesh, cfg, zero),
                                 transform_non_params=lambda _: replicated)


def can_reduce_once(mesh: Any, zero: int) -> bool:
    """Whether this step accumulates per data replica and reduces once (a pipeline: `pipeline.step._run`)."""
    shape = {} if mesh.empty else dict(mesh.shape)
    data = shape.get(DP, 1) * shape.get(CP, 1)
    return data > 1 and zero < 3


def data_axes(mesh: Any) -> tuple[str, ...]:
    """The token axes longer than 1 (XLA keeps an all-reduce over groups of one as an op of its own)."""
    return tuple(a for a in (DP, CP) if mesh.shape[a] > 1)


def batch_spec(axes: tuple[str, ...]) -> P:
    """The [micro-batches, rows, tokens] batch split over the manual data `axes` (rows over dp, tokens over cp)."""
    return P(None, DP if DP in axes else None, CP if CP in axes else None)


def is_expert(names: tuple[str | None, ...]) -> bool:
    """An MoE expert weight (split over dp by its 'experts' dimension)."""
    return "experts" in names


def data_specs(cfg: LlamaConfig, axes: tuple[str, ...], split_dp: bool = False, pipelined: bool = False) -> Any:
    """Each parameter's spec in a shard_map manual over the data `axes`; tp is left to the partitioner."""
    dp = DP in axes

    def spec(names):
        entries = [PP if pipelined and name == "layers" else
                   DP if dp and (name == "experts" or split_dp and name == "embed" and not is_expert(names)) else None
                   for name in names]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return jax.tree.map(spec, llama.param_logical_axes(cfg), is_leaf=_is_names)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` cast to varying over `axes`, so its gradient stays a local partial sum."""
    def cast(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def reduce_gradients(grads: Any, cfg: LlamaConfig, split_dp: bool, payload: str = "none", residual: Any = None
                     ) -> tuple[Any, Any]:
    """Sum partial gradients over the manual data axes; experts over cp only (all_to_all's backward took them home).
    With a `payload` (bf16, int8) the dense sums are compressed with error feedback: (sums, new residual)."""
    axes = data_axes(current())
    leaves, treedef = jax.tree.flatten(grads)
    names = jax.tree.leaves(llama.param_logical_axes(cfg), is_leaf=_is_names)
    res = jax.tree.leaves(residual) if residual is not None else None
    dense = [i for i, n in enumerate(names) if not is_expert(n)]
    experts = [i for i, n in enumerate(names) if is_expert(n)]
    if payload != "none":
        pairs = [_compressed_leaf(leaves[i], res[i], names[i], axes, split_dp, payload) for i in dense]
        reduced = [p[0] for p in pairs]
        res = list(res)
        for i, p in zip(dense, pairs):
            res[i] = p[1]
    elif split_dp:
        reduced = _psum([_scatter_over_dp(leaves[i], names[i]) for i in dense], tuple(a for a in axes if a == CP))
    else:
        reduced = _psum([leaves[i] for i in dense], axes)
    reduced += _psum([leaves[i] for i in experts], tuple(a for a in axes if a != DP))
    by_index = dict(zip(dense + experts, reduced))
    out = jax.tree.unflatten(treedef, [by_index[i] for i in range(len(leaves))])
    return out, None if res is None else jax.tree.unflatten(treedef, res)


def _compressed_leaf(g: jax.Array, r: jax.Array, names: tuple[str | None, ...], axes: tuple[str, ...],
                     split_dp: bool, payload: str) -> tuple[jax.Array, jax.Array]:
    """One dense gradient's compressed sum (ZeRO-1: reduce-scatter over dp, then an exact sum over cp) and its
    residual ([1, *shape], this device's), per tp block: a flatten of a tp-sharded leaf would gather it."""
    tp_only = P(*(TP if entry == TP else None for entry in logical_to_spec(names)))
    r_spec = P(None, *tp_only)

    def one(g, r):
        if split_dp:
            out, err = compressed_sum_scatter(g, r[0], DP, names.index("embed"), payload)
            out = lax.psum(out, CP) if CP in axes else out
        else:
            out, err = compressed_sum(g, r[0], axes, payload)
        return out, err[None]

    return rules.per_device(one, (tp_only, r_spec), (tp_only, r_spec))(g, r)


def _psum(xs: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    return lax.psum(xs, axes) if axes else xs


def _scatter_over_dp(g: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Reduce-scatter one gradient over dp by 'embed', manual over tp too (else XLA gathers it over tp first)."""
    tp_only = P(*(TP if entry == TP else None for entry in logical_to_spec(names)))
    scatter = lambda x: lax.psum_scatter(x, DP, scatter_dimension=names.index("embed"), tiled=True)  # noqa: E731
    return rules.per_device(scatter, tp_only, tp_only)(g)


def reduce_once(accumulate: Any, params: Any, batch: Any, cfg: LlamaConfig, zero: int, payload: str = "none",
                residual: Any = None) -> tuple[Any, ...]:
    """Mean loss, gradients and router metrics with one reduction over the data axes per step;
    `accumulate(params, batch) -> (loss_sum, token_count, grad_sum, router_metrics)` runs per device.
    With a compression `payload` and its `residual` (`residual_shardings`), the new residual comes fourth."""
    axes = data_axes(current())
    split_dp = zero == 1 and DP in axes

    def body(params, batch, residual):
        loss, count, grads, router = accumulate(vary(params, axes), batch)
        loss, count = lax.psum((loss, count), axes)
        grads, residual = reduce_gradients(grads, cfg, split_dp, payload, residual)
        return loss / count, jax.tree.map(lambda g: g / count, grads), router, residual

    res_specs = None if residual is None else jax.tree.map(lambda _: P(axes), residual)
    specs = (P(), data_specs(cfg, axes, split_dp), P(), res_specs)
    out = jax.shard_map(body, in_specs=(data_specs(cfg, axes), batch_spec(axes), res_specs), out_specs=specs,
                        axis_names=set(axes))(params, batch, residual)
    return out if residual is not None else out[:3]


def residual_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """Error feedback's residuals: one gradient-shaped fp32 array per data replica, [dp * cp, *shape], the
    leading axis over the data axes and the rest as the parameter (zero < 3: not over dp); [dp * cp, 0] for an
    expert weight, whose gradient stays on its replica and is never compressed."""
    axes = data_axes(mesh)
    names = llama.param_logical_axes(cfg)
    return jax.tree.map(lambda n, s: NamedSharding(mesh, P(axes) if is_expert(n) else P(axes, *s.spec)),
                        names, param_shardings(mesh, cfg, zero), is_leaf=_is_names)


def init_residual(params: Any, mesh: Mesh, cfg: LlamaConfig) -> Any:
    """Zero residuals for `params` (traced inside a jit whose out_shardings are `residual_shardings`)."""
    n = 1
    for a in data_axes(mesh):
        n *= mesh.shape[a]
    return jax.tree.map(lambda names, p: jnp.zeros((n, 0) if is_expert(names) else (n, *p.shape), jnp.float32),
                        llama.param_logical_axes(cfg), params, is_leaf=_is_names)
