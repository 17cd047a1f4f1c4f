"""Meta-learning on the outer loop: Reptile, first-order MAML and MAML over tasks (`meta.*`).

A task is a data source (`meta.tasks`, or a value of `meta.task_field`); each dp replica (of an MoE, each expert
group of ep devices) is a group that adapts the meta-parameters `TrainState.params` to its step's task by
`meta.inner_steps` SGD steps at `meta.inner_lr`, one micro-batch each, with no communication between groups (with
pp, cp or ep > 1 each group adapts a copy through the strategy: `over_copies`; an MoE's router statistics are the
group's own, `mesh.replica_groups`); the groups then meet once, in one mean over dp:
- reptile: the adapted parameters are averaged and the outer loop's step (`outer.outer_step`, DiLoCo's:
  SGD with `train.outer_lr` and Nesterov `train.outer_momentum`) moves the meta-parameters toward them;
- fomaml: the gradient of the task's loss on one more micro-batch (the query), at the adapted parameters;
- maml: the same loss differentiated through the inner steps (`jax.grad` of the whole adaptation).
fomaml's and maml's mean meta-gradient goes to the run's AdamW (train.lr, its schedule and clipping). Sigmoid
routing's selection biases move by their loads, never by SGD or AdamW: in each inner step and by the query's.
With `train.grad_compression` that one mean travels in its payload with error feedback (`outer.compressed_mean`,
DiLoCo's outer average's code).
The task data comes from `pjax.data.tasks.TaskIterator`: group g's rows hold one task per step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import replica_groups
from mesh.errors import ConfigError
from mesh.mesh import CP, DP, EP, PP, current
from models import bias_balance
from pjax.divergence import keep_if_finite
from pjax.optim import lr_schedule, schedule_count
from pjax.parallel import data_parallel, outer


def check_run(run: Any) -> None:
    """One line where `meta.algorithm` cannot run on this layout or these tasks."""
    meta, tc, mesh = run.meta, run.train, run.mesh
    if meta.algorithm is None:
        return
    head = f"meta.algorithm={meta.algorithm}"
    if mesh.pp > 1 and meta.algorithm == "maml":
        raise ConfigError(f"{head} does not run with mesh.pp={mesh.pp}: use mesh.pp=1, or meta.algorithm=fomaml or "
                          f"reptile (reverse-mode differentiation cannot enter a pipeline's lax.while_loop).")
    if meta.algorithm == "maml" and tc.sequence_parallel and mesh.tp > 1:
        raise ConfigError(f"{head} does not run with train.sequence_parallel: set it to false, or use "
                          f"meta.algorithm=fomaml or reptile (its shard_maps have no second derivative in jax 0.10.2).")
    if meta.algorithm == "maml" and mesh.cp > 1 and run.context.strategy == "ulysses":
        raise ConfigError(f"{head} does not run with context.strategy=ulysses: use ring or all_gather, or "
                          f"meta.algorithm=fomaml or reptile (its all-to-alls have no second derivative in jax "
                          f"0.10.2).")
    if meta.algorithm == "maml" and run.model.num_local_experts and run.moe.routing == "dropless":
        ample = run.model.num_local_experts / run.model.num_experts_per_tok
        raise ConfigError(f"{head} does not run with moe.routing=dropless: use moe.routing=capacity with "
                          f"moe.capacity_factor >= {ample:g}, or meta.algorithm=fomaml or reptile "
                          f"(docs/outer_loops.md).")
    if mesh.pp > 1 and run.pipeline.schedule == "interleaved":
        raise ConfigError(f"{head} does not run with pipeline.schedule=interleaved: use 1f1b (or afab, zb_h1, zb_v); "
                          f"an inner step is one micro-batch, and interleaved needs groups of mesh.pp={mesh.pp}.")
    _check_compression(run, head)
    refused = [(tc.zero > 0, f"train.zero={tc.zero}", "train.zero=0"),
               (tc.local_steps > 0, f"train.local_steps={tc.local_steps}", "train.local_steps=0")]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"{head} does not run with {what}; use {fix}.")
    groups = mesh.model_copies(run.model.num_local_experts)
    if len(meta.tasks) % groups:
        where = f"mesh.dp={mesh.dp}" if groups == mesh.dp else f"{groups} (mesh.dp={mesh.dp} / mesh.ep)"
        raise ConfigError(f"meta.tasks names {len(meta.tasks)} tasks, which do not divide over the {where} "
                          f"groups that adapt in parallel; name a multiple of {groups} tasks, or change mesh.dp.")
    reads = meta.inner_steps + meta.query
    if tc.grad_accum != reads:
        query = " and 1 to take the meta-gradient on" if meta.query else ""
        raise ConfigError(f"{head} with meta.inner_steps={meta.inner_steps} reads {reads} micro-batches per step "
                          f"({meta.inner_steps} to adapt{query}): set train.grad_accum={reads}.")


def _check_compression(run: Any, head: str) -> None:
    """One line where `train.grad_compression` cannot carry the meta step's one mean over the groups."""
    tc, mesh = run.train, run.mesh
    if tc.grad_compression == "none":
        return
    with_it = f"{head} with train.grad_compression={tc.grad_compression}"
    if mesh.dp < 2:
        raise ConfigError(f"{with_it} and mesh.dp={mesh.dp}: set mesh.dp >= 2, or train.grad_compression=none "
                          f"(it compresses the one mean over the groups, the dp replicas).")
    if tc.powersgd_start > 0:
        raise ConfigError(f"{with_it} compresses from the first meta step: set train.powersgd_start=0.")
    if run.meta.algorithm == "maml" and mesh.cp > 1:
        raise ConfigError(f"{with_it} and mesh.cp={mesh.cp}: use mesh.cp=1, meta.algorithm=fomaml or reptile, or "
                          f"train.grad_compression=none (docs/outer_loops.md).")


def meta_optimizer(meta: Any, tc: Any, adamw: optax.GradientTransformation) -> optax.GradientTransformation:
    """Reptile steps by the outer loop's SGD; fomaml and maml hand their meta-gradient to the run's AdamW."""
    return outer.outer_optimizer(tc) if meta.algorithm == "reptile" else adamw


@dataclasses.dataclass(frozen=True)
class Meta:
    """The step with a `meta.algorithm`: adapt per group, meet once, update the meta-parameters."""

    spec: Any  # pjax.spec.StepSpec
    meta: Any  # MetaConfig
    optimizer: optax.GradientTransformation  # `meta_optimizer`'s
    tc: Any  # TrainConfig
    strategy: Any = None  # with pp, cp or ep > 1 the groups adapt through its per_replica_loss_and_grads (`over_copies`)

    def step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One meta-step: {loss (before adapting), adapted_loss, grad_norm, lr, finite}. With
        `train.grad_compression` the mean over the groups (Reptile's of global - adapted) travels in its payload,
        with error feedback in `state.residual` (`outer.compressed_mean`)."""
        residual, reptile = state.residual, self.meta.algorithm == "reptile"
        target, loss, adapted = self.over_tasks(state.params, batch, stacked=residual is not None)
        if residual is not None:
            target, residual = outer.compressed_mean(self.spec.cfg, self.tc.grad_compression, target, residual,
                                                     state.params if reptile else None)
        if reptile and residual is not None:  # target: the mean of global - adapted
            params, opt_state = outer.outer_update(self.optimizer, state.params, state.opt_state, target)
            grad_norm, lr = optax.tree.norm(target), jnp.asarray(self.tc.outer_lr, jnp.float32)
        elif reptile:
            params, opt_state = outer.outer_step(self.optimizer, state.params, state.opt_state, target)
            grad_norm = optax.tree.norm(jax.tree.map(jnp.subtract, state.params, target))
            lr = jnp.asarray(self.tc.outer_lr, jnp.float32)
        else:  # the query's loads move the selection biases, outside AdamW (as in `pjax.step.train_step`)
            loads, target = bias_balance.split_loads(target)
            updates, opt_state = self.optimizer.update(target, state.opt_state, state.params)
            params, grad_norm = optax.apply_updates(state.params, updates), optax.tree.norm(target)
            params = bias_balance.moved(params, state.params, loads, self.spec.moe.bias_update_rate)
            lr = lr_schedule(self.tc)(schedule_count(state.opt_state))
        finite = jnp.isfinite(loss) & jnp.isfinite(adapted) & jnp.isfinite(grad_norm)
        if self.tc.on_nonfinite == "skip":
            params, opt_state, residual = keep_if_finite(finite, (params, opt_state, residual),
                                                         (state.params, state.opt_state, state.residual))
        metrics = {"loss": loss, "adapted_loss": adapted, "grad_norm": grad_norm, "lr": lr, "finite": finite}
        return state._replace(step=state.step + 1, params=params, opt_state=opt_state, residual=residual), metrics

    def over_tasks(self, params: Any, batch: Any, stacked: bool = False) -> tuple[Any, jax.Array, jax.Array]:
        """`per_task` in every group at once (a shard_map manual over dp), then the mean over the groups (with
        `stacked`, each group's row of a [groups, ...] stack instead; the losses are means either way)."""
        axes = data_parallel.data_axes(current())
        if current().shape[PP] > 1 or CP in axes or EP in axes:
            return self.over_copies(params, batch, stacked)
        if not axes:
            return self.per_task(params, batch)

        def body(params, batch):
            with replica_groups.replica_groups(1):  # each replica adapts to its own task
                out = self.per_task(data_parallel.vary(params, axes), batch)
            if not stacked:
                return lax.pmean(out, DP)
            return (jax.tree.map(lambda t: t[None], out[0]), *lax.pmean(out[1:], DP))
        return jax.shard_map(body, in_specs=(P(), data_parallel.batch_spec(axes)),
                             out_specs=(P(DP) if stacked else P(), P(), P()), axis_names=set(axes))(params, batch)

    def over_copies(self, params: Any, batch: Any, stacked: bool = False) -> tuple[Any, jax.Array, jax.Array]:
        """`over_tasks` with pp, cp or ep > 1: every group's parameters stacked [groups, ...] and adapted by the
        strategy's step without dp (a pipeline per group, a sum over cp, an expert group over ep), one micro-batch
        per inner step."""
        n = self.meta.inner_steps
        grads_of = lambda p, micro: self.strategy.per_replica_loss_and_grads(  # noqa: E731
            p, jax.tree.map(lambda x: x[None], micro))[:2]

        def one(p, micro):
            loss, grads = grads_of(p, micro)
            return self.sgd(p, grads), loss

        def adapt(p):
            return lax.scan(one, outer.copies(p, current().shape[DP]), jax.tree.map(lambda x: x[:n], batch))

        query = jax.tree.map(lambda x: x[n], batch) if self.meta.query else None
        if self.meta.algorithm == "maml":  # the mean query loss differentiated through every group's adaptation
            def through_adaptation(p):
                adapted, losses = adapt(p)
                return grads_of(adapted, query)[0], losses[0]
            (after, before), grads = jax.value_and_grad(through_adaptation, has_aux=True)(params)
            return grads, before, after
        mean = (lambda tree: tree) if stacked else (lambda tree: jax.tree.map(lambda x: jnp.mean(x, axis=0), tree))
        adapted, losses = adapt(params)
        if self.meta.algorithm == "reptile":
            return mean(adapted), losses[0], losses[-1]
        after, grads = grads_of(adapted, query)
        return mean(grads), losses[0], after

    def per_task(self, params: Any, batch: Any) -> tuple[Any, jax.Array, jax.Array]:
        """One task's (adapted parameters or meta-gradient, loss before adapting, loss after)."""
        n = self.meta.inner_steps
        support = jax.tree.map(lambda x: x[:n], batch)
        if self.meta.algorithm == "reptile":
            adapted, losses = self.adapt(params, support)
            return adapted, losses[0], losses[-1]
        query = jax.tree.map(lambda x: x[n], batch)
        if self.meta.algorithm == "fomaml":
            adapted, losses = self.adapt(params, support)
            after, grads = jax.value_and_grad(self.task_loss)(lax.stop_gradient(adapted), query)
            return grads, losses[0], after

        def through_adaptation(p):
            adapted, losses = self.adapt(p, support)
            return self.task_loss(adapted, query), losses[0]
        (after, before), grads = jax.value_and_grad(through_adaptation, has_aux=True)(params)
        return grads, before, after

    def adapt(self, params: Any, support: Any) -> tuple[Any, jax.Array]:
        """SGD at meta.inner_lr, one step per support micro-batch: the adapted parameters and each step's loss."""
        def one(p, micro):
            loss, grads = jax.value_and_grad(self.task_loss)(p, micro)
            return self.sgd(p, grads), loss
        return lax.scan(one, params, support)

    def sgd(self, params: Any, grads: Any) -> Any:
        """One inner step at meta.inner_lr; sigmoid routing's selection biases moved by their loads instead, as a
        training step moves them (`models/bias_balance.py`)."""
        loads, grads = bias_balance.split_loads(grads)
        new = jax.tree.map(lambda w, g: w - self.meta.inner_lr * g.astype(w.dtype), params, grads)
        return bias_balance.moved(new, params, loads, self.spec.moe.bias_update_rate)

    def task_loss(self, params: Any, micro: Any) -> jax.Array:
        """Mean token loss of one micro-batch."""
        loss, (count, _) = self.spec.loss_sum(params, micro)
        return loss / count
