"""The outer loop: `outer_step`, which DiLoCo (here) and Reptile (`meta.py`) share, and DiLoCo (Douillard
et al., 2023), data parallelism that talks once every H steps.

Each dp replica is a group that keeps its own copy of the parameters and of the inner AdamW state
(`TrainState.local`, a leading [groups] axis split over dp) and steps on its own rows of every batch, with no
dp communication: its gradient is summed over cp only, tp stays with the partitioner as in every step. Every
`train.local_steps` (H) steps the groups' parameters are averaged (one fp32 all-reduce of the model over dp),
their distance from the global parameters `TrainState.params` is the outer gradient, and an outer SGD with
Nesterov momentum (`train.outer_lr`, `train.outer_momentum`; the paper's 0.7 and 0.9) moves the global
parameters, which every group then starts its next round from. `TrainState.opt_state` is that outer
optimizer's state; evaluation and export read the global parameters, as of the last synchronisation.

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
from mesh.mesh import CP, DP, current
from pjax.divergence import keep_if_finite
from pjax.optim import lr_schedule, schedule_count
from pjax.parallel import data_parallel
from pjax.spec import accumulate


def check_run(run: Any) -> None:
    """One line where DiLoCo (`train.local_steps` > 0) cannot run on this layout."""
    tc, mesh = run.train, run.mesh
    if not tc.local_steps:
        return
    head = f"train.local_steps={tc.local_steps} (DiLoCo)"
    if mesh.dp < 2:
        raise ConfigError(f"{head} syncs dp groups, and this mesh has dp={mesh.dp}: set mesh.dp >= 2, or "
                          f"train.local_steps=0.")
    if tc.diloco_groups not in (None, mesh.dp):
        raise ConfigError(f"{head} with train.diloco_groups={tc.diloco_groups}: groups are the dp replicas "
                          f"(mesh.dp={mesh.dp}); set train.diloco_groups={mesh.dp} or null, and put the devices "
                          f"of a group on tp, cp (groups of several dp replicas are not built).")
    refused = [(mesh.pp > 1, f"mesh.pp={mesh.pp}", "mesh.pp=1"),
               (tc.zero > 0, f"train.zero={tc.zero}", "train.zero=0 (a group has no dp replicas to split over)"),
               (tc.grad_compression != "none", f"train.grad_compression={tc.grad_compression}",
                "train.grad_compression=none (the groups reduce no gradients)"),
               (run.model.num_local_experts > 0, "an MoE model", "a dense model (experts are split over dp)")]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"{head} does not run with {what}; use {fix}, or train.local_steps=0.")


def outer_optimizer(tc: Any) -> optax.GradientTransformation:
    """The outer optimizer: SGD at `train.outer_lr`, Nesterov momentum `train.outer_momentum` (none at 0)."""
    momentum = tc.outer_momentum or None
    return optax.sgd(tc.outer_lr, momentum=momentum, nesterov=momentum is not None)


def outer_step(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, average: Any
               ) -> tuple[Any, Any]:
    """The step both outer loops take (DiLoCo's, Reptile's): `params - average` is the outer gradient."""
    delta = jax.tree.map(lambda p, a: (p - a).astype(p.dtype), params, average)
    updates, opt_state = optimizer.update(delta, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def stacked(sharding: Any) -> Any:
    """A [groups, ...] sharding: the groups over dp, the rest as `sharding` places one group's copy."""
    def one(s: NamedSharding) -> NamedSharding:
        return NamedSharding(s.mesh, P(DP, *s.spec))
    return jax.tree.map(one, sharding)


def local_shardings(mesh: Mesh, inner: optax.GradientTransformation, p_sharding: Any, params_shape: Any) -> Any:
    """Where `TrainState.local` lives: every leaf of the groups' parameters and inner state over dp first."""
    state_shape = jax.eval_shape(inner.init, params_shape)
    replicated = NamedSharding(mesh, P())
    inner_sharding = optax.tree_map_params(inner, lambda _, s: s, state_shape, p_sharding,
                                           transform_non_params=lambda _: replicated)
    return {"params": stacked(p_sharding), "opt_state": stacked(inner_sharding)}


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

    spec: Any  # pjax.spec.StepSpec
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    tc: Any  # TrainConfig

    def step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One inner step in every group; after every H-th, the outer step. Metrics as `train_step`'s."""
        local, loss, grad_norm = self.inner_step(state.local, batch)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if self.tc.on_nonfinite == "skip":
            local = keep_if_finite(finite, local, state.local)
        sync = (state.step + 1) % self.tc.local_steps == 0
        params, opt_state, local = lax.cond(sync, self.synchronise, lambda *a: a, state.params, state.opt_state, local)
        lr = lr_schedule(self.tc)(schedule_count(state.local["opt_state"])[0])  # every group's count is the same
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite}
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state, local=local), metrics

    def inner_step(self, local: Any, batch: Any) -> tuple[Any, jax.Array, jax.Array]:
        """Each group's AdamW step on its rows, summed over cp only: (new local state, global mean loss,
        mean of the groups' gradient norms). The loss, token count and norm are all that crosses dp."""
        mesh_axes = data_parallel.data_axes(current())
        in_group = tuple(a for a in mesh_axes if a == CP)

        def body(local, batch):
            one = jax.tree.map(lambda x: x[0], local)
            params = data_parallel.vary(one["params"], in_group)
            loss, count, grads, _ = accumulate(params, batch, self.spec)
            grads = lax.psum(grads, in_group) if in_group else grads
            loss, count = lax.psum((loss, count), in_group) if in_group else (loss, count)
            grads = jax.tree.map(lambda g: (g / count).astype(jnp.float32), grads)
            updates, opt_state = self.inner.update(grads, one["opt_state"], one["params"])
            new = {"params": optax.apply_updates(one["params"], updates), "opt_state": opt_state}
            norm = optax.tree.norm(grads)
            total, tokens = lax.psum((loss, count), DP)
            return jax.tree.map(lambda x: x[None], new), total / tokens, lax.pmean(norm, DP)

        specs = jax.tree.map(lambda _: P(DP), local)
        return jax.shard_map(body, in_specs=(specs, data_parallel.batch_spec(mesh_axes)),
                             out_specs=(specs, P(), P()), axis_names=set(mesh_axes))(local, batch)

    def synchronise(self, params: Any, opt_state: Any, local: Any) -> tuple[Any, Any, Any]:
        """Average the groups (the all-reduce over dp), step the global parameters by the outer optimizer
        along (global - average), and start every group from the result."""
        average = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), local["params"])
        params, opt_state = outer_step(self.outer, params, opt_state, average)
        groups = jax.tree.leaves(local["params"])[0].shape[0]
        return params, opt_state, {**local, "params": copies(params, groups)}
