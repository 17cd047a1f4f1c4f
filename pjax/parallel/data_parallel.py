"""Data parallelism and ZeRO over `dp`: zero=1 splits the Adam moments by 'embed', zero=3 (FSDP) the parameters too;
when each reduces: ARCHITECTURE.md, "Gradients reduced once per step"."""
from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax import lax

from mesh import replica_groups, rules
from mesh.mesh import CP, DATA, DP, EP, PP, RP, TP, current, data_size
from mesh.rules import logical_to_spec, param_rules, rows_axes, vary, zero_axes  # noqa: F401 (this module's API)
from models import llama
from mesh.errors import ConfigError
from models.config import LlamaConfig
from pjax.parallel import feedback, groups, overlap

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


def check_run(run: Any) -> None:
    """One line where `train.zero_shard` (HSDP: ZeRO within groups of N data replicas, copied across) cannot split
    this run."""
    tc, mesh = run.train, run.mesh
    n = tc.zero_shard
    if not n or n == mesh.dp:
        return
    mesh.with_experts(run.model.num_local_experts, zero_shard=n).check_zero_shard(n)
    head = f"train.zero_shard={n}"
    refused = [(tc.local_steps > 0, f"train.local_steps={tc.local_steps} (DiLoCo)",
                "train.diloco_groups (DiLoCo shards its groups' state within them)"),
               (tc.grad_compression != "none", f"train.grad_compression={tc.grad_compression}",
                "train.grad_compression=none (its compressed reduce-scatter spans all of dp)")]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"{head} does not run with {what}; use {fix}, or train.zero_shard=0.")


def check_shard_groups(mesh: Mesh, tc: Any) -> None:
    """One line where a built mesh's ZeRO groups are not `train.zero_shard`'s (build it with `pjax.step.mesh_for`)."""
    groups = mesh.shape[RP]
    want = data_size(mesh) // tc.zero_shard if tc.zero_shard else 1
    if groups != want:
        raise ConfigError(f"train.zero_shard={tc.zero_shard} asks for {want} ZeRO group(s), and the mesh has {groups}; "
                          f"build the mesh with pjax.step.mesh_for(config), which splits dp for it.")


def can_reduce_once(mesh: Any, zero: int) -> bool:
    """Whether this step accumulates per data replica and reduces once (a pipeline: `pipeline.step._run`)."""
    cp = 1 if mesh.empty else mesh.shape.get(CP, 1)
    return data_size(mesh) * cp > 1 and zero < 3


def data_axes(mesh: Any) -> tuple[str, ...]:
    """The token axes longer than 1 (XLA keeps an all-reduce over groups of one as an op of its own)."""
    return tuple(a for a in (*DATA, CP) if mesh.shape[a] > 1)


def batch_spec(axes: tuple[str, ...]) -> P:
    """The [micro-batches, rows, tokens] batch split over the manual data `axes` (rows over rp x dp x ep, tokens
    over cp)."""
    return P(None, rows_axes(axes), CP if CP in axes else None)


def is_expert(names: tuple[str | None, ...]) -> bool:
    """An MoE expert weight (split over ep by its 'experts' dimension, copied over dp)."""
    return "experts" in names


def zero_axis(names: tuple[str | None, ...]) -> int | None:
    """The dimension ZeRO splits a dense weight's state by: its 'embed' one. A weight with none (Qwen's per-head
    q/k norm scales and q/k/v biases) is never split: kept whole on every replica, its gradient reduced whole."""
    return names.index("embed") if "embed" in names else None


def data_specs(cfg: LlamaConfig, axes: tuple[str, ...], split_dp: bool = False, pipelined: bool = False) -> Any:
    """Each parameter's spec in a shard_map manual over the data `axes` (ZeRO-1's `split_dp`: 'embed' over the ZeRO
    axes, dp x ep); tp is left to the partitioner."""
    rows = zero_axes(axes)

    def spec(names):
        entries = [PP if pipelined and name == "layers" else
                   EP if EP in axes and name == "experts" else
                   rows if split_dp and name == "embed" and not is_expert(names) else None
                   for name in names]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return jax.tree.map(spec, llama.param_logical_axes(cfg), is_leaf=_is_names)


def reduce_gradients(grads: Any, cfg: LlamaConfig, split_dp: bool, mode: str = "none", state: Any = None,
                     axes: tuple[str, ...] | None = None) -> tuple[Any, Any]:
    """Sum partial gradients over the manual data axes (or `axes`); experts over all but ep (all_to_all's backward
    took them home). With a compression `mode` the dense sums are compressed with error feedback
    (`feedback.reduce_leaf`): (sums, the new feedback state)."""
    axes = data_axes(current()) if axes is None else axes
    leaves, treedef = jax.tree.flatten(grads)
    names = jax.tree.leaves(llama.param_logical_axes(cfg), is_leaf=_is_names)
    dense = [i for i, n in enumerate(names) if not is_expert(n)]
    experts = [i for i, n in enumerate(names) if is_expert(n)]
    packed = [i for i in dense if mode != "none" and feedback.compresses(names[i], mode)]
    exact = [i for i in dense if i not in packed]
    if split_dp:
        whole = [i for i in exact if zero_axis(names[i]) is None]
        exact = [i for i in exact if i not in whole] + whole
        reduced = _psum([_scatter_over_dp(leaves[i], names[i]) for i in exact[:len(exact) - len(whole)]],
                        tuple(a for a in axes if a in (RP, CP))) + _psum([leaves[i] for i in whole], axes)
    else:
        reduced = _psum([leaves[i] for i in exact], axes)
    if packed:
        errors = jax.tree.leaves(state["error"])
        qs = jax.tree.leaves(state["q"]) if "q" in state else [None] * len(leaves)
        for i in packed:
            out, errors[i], qs[i] = feedback.reduce_leaf(leaves[i], errors[i], qs[i], names[i], axes, split_dp, mode)
            reduced.append(out)
        state = {k: jax.tree.unflatten(treedef, v) for k, v in (("error", errors), ("q", qs)) if k in state}
    reduced += _psum([leaves[i] for i in experts], tuple(a for a in axes if a != EP))
    by_index = dict(zip(exact + packed + experts, reduced))
    return jax.tree.unflatten(treedef, [by_index[i] for i in range(len(leaves))]), state


def _psum(xs: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    return lax.psum(xs, axes) if axes else xs


def _scatter_over_dp(g: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Reduce-scatter one gradient over ZeRO's axes (dp x ep; rp's copies are summed after) by 'embed', manual over
    tp too (else XLA gathers it over tp first)."""
    tp_only = P(*(TP if entry == TP else None for entry in logical_to_spec(names)))
    rows = zero_axes(current().manual_axes)
    scatter = lambda x: lax.psum_scatter(x, rows, scatter_dimension=names.index("embed"), tiled=True)  # noqa: E731
    return rules.per_device(scatter, tp_only, tp_only)(g)


def reduce_once(accumulate: Any, params: Any, batch: Any, cfg: LlamaConfig, zero: int, mode: str = "none",
                residual: Any = None) -> tuple[Any, ...]:
    """Mean loss, gradients and router metrics with one reduction over the data axes per step;
    `accumulate(params, batch) -> (loss_sum, token_count, grad_sum, router_metrics)` runs per device.
    With a compression `mode` and its feedback state `residual` (`feedback.shardings`), the new state comes fourth."""
    axes = data_axes(current())
    split_dp = zero == 1 and zero_axes(axes) is not None

    def body(params, batch, residual):
        loss, count, grads, router = accumulate(vary(params, axes), batch)
        loss, count = lax.psum((loss, count), axes)
        grads, residual = reduce_gradients(grads, cfg, split_dp, mode, residual)
        return loss / count, jax.tree.map(lambda g: g / count, grads), router, residual

    res_specs = None if residual is None else jax.tree.map(lambda _: P(axes), residual)
    specs = (P(), data_specs(cfg, axes, split_dp), P(), res_specs)
    out = jax.shard_map(body, in_specs=(data_specs(cfg, axes), batch_spec(axes), res_specs), out_specs=specs,
                        axis_names=set(axes))(params, batch, residual)
    return out if residual is not None else out[:3]


def per_replica(accumulate: Any, stacked_params: Any, batch: Any, cfg: LlamaConfig, group_size: int = 1,
                scatter: bool = False) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Each dp replica's own mean gradient, with no reduction over dp beyond its group of `group_size` replicas
    (DiLoCo's groups, `pjax.parallel.outer`): `stacked_params` carry a leading [replicas] axis over dp, and so
    do the gradients returned with the global mean loss and the router metrics (each group's, averaged over
    the groups). A replica is an expert group: its gradient is summed over ep (the experts' over none: each
    device's own) and cp, and over the group's replicas; tp stays with the partitioner. With `scatter` (DiLoCo
    under ZeRO) the group's sum is reduce-scattered by 'embed': each replica keeps its chunk
    (`groups.group_scatter`)."""
    axes = replica_axes(current())
    in_group = axes[1:]

    def body(params, batch):
        one = jax.tree.map(lambda x: x[0], params)
        with replica_groups.replica_groups(group_size):
            loss, count, grads, router = accumulate(vary(one, in_group), batch)
        grads = reduce_gradients(grads, cfg, False, axes=in_group)[0]
        loss, count = _psum([loss, count], in_group)
        total, tokens = lax.psum((overlap.waits(loss), overlap.waits(count)), DP)
        if scatter:
            grads, count = scatter_in_group(grads, cfg, group_size), groups.group_sum(count, group_size)
        else:
            grads, count = groups.group_sum((grads, count), group_size)
        return total / tokens, jax.tree.map(lambda g: g[None] / count, grads), lax.pmean(router, DP)

    specs = stacked_specs(data_specs(cfg, axes))
    return jax.shard_map(body, in_specs=(specs, batch_spec(axes)), out_specs=(P(), specs, P()),
                         axis_names=set(axes))(stacked_params, batch)


def scatter_in_group(grads: Any, cfg: LlamaConfig, group_size: int) -> Any:
    """Each replica's chunk, by 'embed', of its group's sum of `grads` (`groups.group_scatter`; DiLoCo under ZeRO)."""
    def one(g, names):
        axis = zero_axis(names)
        return groups.group_sum(g, group_size) if axis is None else groups.group_scatter(g, group_size, axis)
    return jax.tree.map(one, grads, llama.param_logical_axes(cfg), is_leaf=_is_names)


def replica_axes(mesh: Any) -> tuple[str, ...]:
    """The manual axes of a per-replica step: dp (even at 1: the replicas' axis), then ep and cp where they split
    a replica's tokens."""
    return (DP, *(a for a in (EP, CP) if mesh.shape[a] > 1))


def stacked_specs(specs: Any) -> Any:
    """Specs with a leading [replicas] axis over dp in front of each."""
    return jax.tree.map(lambda s: P(DP, *s), specs)

