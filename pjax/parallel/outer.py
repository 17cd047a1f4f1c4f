"""The outer loop: `outer_step`, which DiLoCo (here) and Reptile (`meta.py`) share, and DiLoCo (Douillard
et al., 2023), data parallelism that talks once every H steps.

Each group of dp replicas (one each, or dp / `train.diloco_groups`) keeps its own copy of the parameters and
of the inner AdamW state (`TrainState.local`: one copy per replica, a leading [replicas] axis split over dp,
alike within a group) and steps on its own rows of every batch, with no communication between groups: its
gradient is summed over cp and over the group's replicas only (`groups.group_sum`), tp stays with the
partitioner as in every step, and with pp > 1 the pipeline runs once per replica. Every
`train.local_steps` (H) steps the groups' parameters are averaged (one fp32 all-reduce of the model over dp, or
its difference from the global parameters in `train.grad_compression`'s payload with error feedback),
their distance from the global parameters `TrainState.params` is the outer gradient, and an outer SGD with
Nesterov momentum (`train.outer_lr`, `train.outer_momentum`; the paper's 0.7 and 0.9) moves the global
parameters, which every group then starts its next round from. `TrainState.opt_state` is that outer
optimizer's state; evaluation and export read the global parameters, as of the last synchronisation.

Under `train.zero` 1 or 3 each group's inner state is sharded over the group's replicas (`group_zero`).

With H = 1, an outer lr of 1, no momentum and an SGD inner optimizer this is synchronous data parallelism
(tests/test_diloco.py checks it).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import DP, PP, current
from models import bias_balance
from pjax.divergence import keep_if_finite
from pjax.optim import lr_schedule, schedule_count
from pjax.parallel import data_parallel, feedback, group_zero, overlap


def check_run(run: Any) -> None:
    """One line where DiLoCo (`train.local_steps` > 0) cannot run on this layout or reach a synchronisation, or
    where an outer optimizer key is set and no outer loop reads it."""
    tc, mesh = run.train, run.mesh
    if not tc.local_steps:
        _outer_keys_unused(tc, run.meta.algorithm)
        return
    head = f"train.local_steps={tc.local_steps} (DiLoCo)"
    copies = mesh.model_copies(run.model.num_local_experts, copies_needed(tc))
    if mesh.dp < 2:
        raise ConfigError(f"{head} syncs dp groups, and this mesh has dp={mesh.dp}: set mesh.dp >= 2, or "
                          f"train.local_steps=0.")
    if copies < 2:
        raise ConfigError(f"{head} syncs copies of the model, and the experts span all mesh.dp={mesh.dp} replicas "
                          f"(mesh.ep={mesh.dp}): set mesh.ep to a divisor of {mesh.dp} below it, or "
                          f"train.local_steps=0.")
    if tc.steps < tc.local_steps:
        raise ConfigError(f"{head} first synchronises at step {tc.local_steps}, after train.steps={tc.steps}: set "
                          f"train.local_steps <= {tc.steps}, or more train.steps (the export would hold initial "
                          f"parameters).")
    if tc.diloco_groups is not None and copies % tc.diloco_groups:
        raise ConfigError(f"{head} with train.diloco_groups={tc.diloco_groups}: the groups split "
                          f"{_copies(mesh, copies)} evenly; use a divisor of {copies}, or null for one group per "
                          f"replica.")
    if tc.grad_compression != "none" and tc.powersgd_start > 0:
        raise ConfigError(f"{head} does not run with train.powersgd_start={tc.powersgd_start}: use "
                          f"train.powersgd_start=0 (it compresses the outer average from the first sync), or "
                          f"train.local_steps=0.")


def copies_needed(tc: Any) -> int:
    """The fewest whole copies of the model a run's data replicas must hold: DiLoCo's groups average 2 or more
    (an MoE's unset mesh.ep leaves them: `MeshConfig.with_experts`)."""
    return 2 if tc.local_steps else 1


def _copies(mesh: Any, copies: int) -> str:
    """The model's copies on `mesh`, in words: 'the mesh.dp=4 replicas', or an MoE's expert groups."""
    if copies == mesh.dp:
        return f"the mesh.dp={mesh.dp} replicas"
    return f"the {copies} copies of the experts (mesh.dp={mesh.dp} / mesh.ep={mesh.dp // copies})"


def _outer_keys_unused(tc: Any, algorithm: str | None) -> None:
    """One line where an outer optimizer key is set and neither DiLoCo nor Reptile reads it."""
    if algorithm == "reptile":
        return
    for key in ("outer_lr", "outer_momentum"):
        if getattr(tc, key) != type(tc).__dataclass_fields__[key].default:
            raise ConfigError(f"train.{key}={getattr(tc, key)} steps the outer loop, which this run does not have; "
                              f"set train.local_steps > 0 (DiLoCo) or meta.algorithm=reptile, or leave it unset.")


def outer_optimizer(tc: Any) -> optax.GradientTransformation:
    """The outer optimizer: SGD at `train.outer_lr`, Nesterov momentum `train.outer_momentum` (none at 0)."""
    momentum = tc.outer_momentum or None
    return optax.sgd(tc.outer_lr, momentum=momentum, nesterov=momentum is not None)


def outer_step(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, average: Any
               ) -> tuple[Any, Any]:
    """The step both outer loops take (DiLoCo's, Reptile's): `params - average` is the outer gradient."""
    return outer_update(optimizer, params, opt_state, jax.tree.map(jnp.subtract, params, average))


def outer_update(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, delta: Any
                 ) -> tuple[Any, Any]:
    """`outer_step` from the outer gradient `delta` itself (DiLoCo's compressed average arrives as one)."""
    delta = jax.tree.map(lambda p, d: d.astype(p.dtype), params, delta)
    updates, opt_state = optimizer.update(delta, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def stacked(sharding: Any) -> Any:
    """A [groups, ...] sharding: the groups over dp, the rest as `sharding` places one group's copy."""
    def one(s: NamedSharding) -> NamedSharding:
        return NamedSharding(s.mesh, P(DP, *s.spec))
    return jax.tree.map(one, sharding)


def local_shardings(mesh: Mesh, inner: optax.GradientTransformation, cfg: Any, params_shape: Any, tc: Any) -> Any:
    """Where `TrainState.local` lives: every leaf of the groups' parameters and inner state over dp first, each
    group's copy (or ZeRO chunk) placed as without ZeRO, its [replicas] axis being dp's; with streaming DiLoCo's
    overlap, the fragment in flight placed as the copies."""
    p_sharding = data_parallel.param_shardings(mesh, cfg, 0)
    state_shape = jax.eval_shape(inner.init, params_shape)
    replicated = NamedSharding(mesh, P())
    inner_sharding = optax.tree_map_params(inner, lambda _, s: s, state_shape, p_sharding,
                                           transform_non_params=lambda _: replicated)
    local = {"params": stacked(p_sharding), "opt_state": stacked(inner_sharding)}
    return {**local, "inflight": local["params"]} if tc.diloco_overlap else local


def copies(params: Any, groups: int) -> Any:
    """`params` once per group: a [groups, ...] leading axis."""
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (groups, *p.shape)), params)


def fresh_local(params: Any, inner: optax.GradientTransformation, groups: int) -> Any:
    """Every group at the global parameters, with a fresh inner optimizer state."""
    start = copies(params, groups)
    return {"params": start, "opt_state": jax.vmap(inner.init)(start)}


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """The step with `train.local_steps` > 0: inner steps per group, the outer step every H."""

    strategy: Any  # pjax.step.Accumulation or pipeline.step.Pipelined: per_replica_loss_and_grads
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    tc: Any  # TrainConfig

    def fresh(self, params: Any, groups: int, step: int = 0) -> Any:
        """`TrainState.local` at the start (or at a resume's `step`): every group at `params`, a fresh inner state
        (under ZeRO sharded within each group: `group_zero`)."""
        if group_zero.sharded(self.tc, groups):
            size = group_zero.group_replicas(self.tc, groups)
            return group_zero.fresh(params, self.inner, groups, self.strategy.spec.cfg, size, self.tc.zero)
        return fresh_local(params, self.inner, groups)

    def step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One inner step in every group; after every H-th, the outer step. Metrics as `train_step`'s."""
        local, metrics = self.inner_round(state, batch)
        sync = (state.step + 1) % self.tc.local_steps == 0
        params, opt_state, local, residual = lax.cond(sync, self.synchronise, lambda *a: a, state.params,
                                                      state.opt_state, local, state.residual)
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state, local=local,
                              residual=residual), metrics

    def inner_round(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """`inner_step` on the groups' parameters and inner state (other entries of `state.local` kept), a
        non-finite step dropped under on_nonfinite=skip, and the step's metrics (an MoE's router metrics: the
        groups' mean)."""
        own = {k: state.local[k] for k in ("params", "opt_state")}
        new, loss, grad_norm, router = self.inner_step(own, batch)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.tc.on_nonfinite == "skip":
            new = keep_if_finite(finite, new, own)
        # Every group's count is the same; the first one's read over dp (`overlap.waits`: a landing's anchor).
        lr = overlap.waits(lr_schedule(self.tc)(schedule_count(own["opt_state"])))[0]
        return {**state.local, **new}, {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite, **router}

    def inner_step(self, local: Any, batch: Any) -> tuple[Any, jax.Array, jax.Array, dict]:
        """Each group's AdamW step on its rows, its gradient summed over its expert group (ep), cp and the group's
        replicas only (`per_replica_loss_and_grads`), the update vmapped over the replicas, sigmoid routing's
        biases moved by each group's own loads (`models/bias_balance.py`): (new local state, global mean loss,
        mean of the replicas' gradient norms, the groups' mean router metrics). The loss, token count and
        metrics are all that crosses groups."""
        if group_zero.sharded(self.tc, current().shape[DP]):
            return group_zero.inner_step(self, local, batch)
        loss, grads, router = self.strategy.per_replica_loss_and_grads(local["params"], batch, self.group_size())
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        loads, grads = bias_balance.split_loads(grads)
        updates, opt_state = jax.vmap(self.inner.update)(grads, local["opt_state"], local["params"])
        params = self.moved(optax.apply_updates(local["params"], updates), local["params"], loads)
        norm = jnp.mean(overlap.waits(jax.vmap(optax.tree.norm)(grads)))
        return {"params": params, "opt_state": opt_state}, loss, norm, router

    def moved(self, params: Any, before: Any, loads: Any) -> Any:
        """`params` with each group's selection biases moved by its loads at `moe.bias_update_rate`."""
        return bias_balance.moved(params, before, loads, self.strategy.spec.moe.bias_update_rate)

    def group_size(self) -> int:
        """Replicas per group: 1, or dp / `train.diloco_groups`."""
        return group_zero.group_replicas(self.tc, current().shape[DP])

    def synchronise(self, params: Any, opt_state: Any, local: Any, residual: Any = None) -> tuple[Any, ...]:
        """Average the groups (the all-reduce over dp), step the global parameters by the outer optimizer
        along (global - average), and start every group from the result; with `train.grad_compression` the
        average of (global - copy) in its payload, with error feedback in `residual`. Under ZeRO-3 the groups'
        chunks are gathered into whole copies for it, and its result cut into chunks again."""
        if self.chunked():
            whole = {**local, "params": self.whole(local["params"])}
            params, opt_state, local, residual = self._synchronise(params, opt_state, whole, residual)
            return params, opt_state, {**local, "params": self.chunks(local["params"])}, residual
        return self._synchronise(params, opt_state, local, residual)

    def chunked(self) -> bool:
        """Whether the groups' copies are ZeRO-3 chunks (`group_zero`), not whole copies."""
        return self.tc.zero >= 3 and group_zero.sharded(self.tc, current().shape[DP])

    def whole(self, stacked: Any) -> Any:
        """The groups' whole copies from `TrainState.local['params']` (under ZeRO-3 gathered on each group's ring)."""
        return group_zero.gather(stacked, self.strategy.spec.cfg, self.group_size()) if self.chunked() else stacked

    def chunks(self, stacked: Any) -> Any:
        """`whole`'s inverse: each replica's chunk of its group's whole copy under ZeRO-3, else the copies."""
        return group_zero.shard(stacked, self.strategy.spec.cfg, self.group_size()) if self.chunked() else stacked

    def _synchronise(self, params: Any, opt_state: Any, local: Any, residual: Any) -> tuple[Any, ...]:
        """`synchronise` on whole copies."""
        if residual is None:
            average = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), local["params"])
            params, opt_state = outer_step(self.outer, params, opt_state, average)
        else:
            delta, residual = self.compressed_delta(params, local["params"], residual)
            params, opt_state = outer_update(self.outer, params, opt_state, delta)
        replicas = jax.tree.leaves(local["params"])[0].shape[0]
        return params, opt_state, {**local, "params": copies(params, replicas)}, residual

    def compressed_delta(self, params: Any, stacked_params: Any, residual: Any) -> tuple[Any, Any]:
        """The mean over the replicas of (global - copy) in `train.grad_compression`'s payload
        (`compressed_mean`), and the new residuals."""
        return compressed_mean(self.strategy.spec.cfg, self.tc.grad_compression, stacked_params, residual, params)


def compressed_mean(cfg: Any, mode: str, stacked: Any, residual: Any, reference: Any = None) -> tuple[Any, Any]:
    """The mean over the dp replicas of each one's row of the [replicas, ...] `stacked` (or of `reference` - row),
    summed in `mode`'s payload by the gradient reduction's code (`data_parallel.reduce_gradients` over dp alone)
    with error feedback in `residual`: (the mean, the new residuals). DiLoCo's outer average and the meta step's
    mean over the groups."""
    pipelined = current().shape[PP] > 1
    specs = data_parallel.data_specs(cfg, (DP,), pipelined=pipelined)
    r_specs = (feedback.pipelined_specs(cfg, (DP,), residual) if pipelined
               else jax.tree.map(lambda _: P(DP), residual))

    def body(stacked, residual, *reference):
        rows = jax.tree.map(lambda c: c[0].astype(jnp.float32), stacked)
        if reference:
            rows = jax.tree.map(lambda p, c: p.astype(jnp.float32) - c, reference[0], rows)
        total, residual = data_parallel.reduce_gradients(rows, cfg, False, mode, residual, axes=(DP,))
        return jax.tree.map(lambda t: t / lax.axis_size(DP), total), residual

    extra = () if reference is None else (reference,)
    return jax.shard_map(body, in_specs=(data_parallel.stacked_specs(specs), r_specs, *(specs,) * len(extra)),
                         out_specs=(specs, r_specs), axis_names={DP, PP} if pipelined else {DP}
                         )(stacked, residual, *extra)
