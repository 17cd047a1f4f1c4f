"""DiLoCo under ZeRO (`train.zero` 1 or 3 with `train.local_steps`): each group's inner state sharded over the
group's k replicas, as MaxText shards its DiLoCo replicas' state within each replica.

Replica r of a group keeps chunk r % k of every parameter's 'embed' axis (the axis ZeRO splits over dp in a plain
step) of the group's Adam moments, so a device holds 1/k of its group's inner optimizer state; under ZeRO-3 it also
keeps only that chunk of the group's parameters between steps. A step: (ZeRO-3) the group's parameters gathered on
the group's ring (`groups.group_gather`), each replica's gradient reduce-scattered on it (`groups.group_scatter`,
the first half of `group_sum`; with pp > 1 in the pipeline's own reduction), clipped by the group's whole norm (the
chunks' squared norms summed over the group), the AdamW update of the chunk (elementwise, weight-decay mask by path
as ever), and (ZeRO-1) the updated chunks gathered back. Adam is elementwise, so this is DiLoCo without ZeRO up to
the norm's summation order. The outer step reads whole copies: under ZeRO-3 it gathers them and re-shards its
result; the global parameters `TrainState.params` and the outer optimizer's state are placed as ZeRO places a plain
step's (over all of dp, by 'embed'). With groups of one replica (`train.diloco_groups` null or dp) there is nothing
to shard within a group: the groups step as without ZeRO, and ZeRO shards that global state alone. Streaming DiLoCo
cuts its fragments from whole copies too (`DiLoCo.whole`): under ZeRO-3 each send and each landing (once every H /
fragments steps) gathers the group's chunks, beside the gather every inner step makes.
"""
from __future__ import annotations

import math

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from mesh.mesh import DP
from models import bias_balance, llama
from models.config import LlamaConfig
from pjax.parallel import data_parallel, groups, overlap

_is_names = lambda x: isinstance(x, tuple)  # noqa: E731


def group_replicas(tc: Any, replicas: int) -> int:
    """Replicas per DiLoCo group: 1, or dp / `train.diloco_groups`."""
    return replicas // (tc.diloco_groups or replicas)


def sharded(tc: Any, replicas: int) -> bool:
    """Whether ZeRO shards the groups' inner state: `train.zero` > 0 and groups of more than one replica (with one,
    there is nothing to shard within a group: the inner state is DiLoCo's; ZeRO shards the global state alone)."""
    return bool(tc.local_steps and tc.zero) and group_replicas(tc, replicas) > 1


def whole_groups_note(tc: Any, replicas: int) -> str | None:
    """The warning for ZeRO under DiLoCo in groups of one replica (accepted: ZeRO still shards the global state)."""
    if not tc.local_steps or not tc.zero or sharded(tc, replicas):
        return None
    return (f"train.zero={tc.zero} under DiLoCo shards only the global state in groups of one replica: set "
            f"train.diloco_groups below the {replicas} replicas to shard each group's inner state "
            f"(docs/outer_loops.md).")


def embed_axes(cfg: LlamaConfig) -> Any:
    """Each parameter's 'embed' axis, or -1 for one ZeRO keeps whole (`data_parallel.zero_axis`)."""
    def axis(names):
        found = data_parallel.zero_axis(names)
        return -1 if found is None else found
    return jax.tree.map(axis, llama.param_logical_axes(cfg), is_leaf=_is_names)


def _over_dp(body: Callable, cfg: LlamaConfig, tree: Any) -> Any:
    """`body` on each replica's row of the [replicas, ...] parameter-shaped `tree`, manual over dp."""
    specs = data_parallel.stacked_specs(data_parallel.data_specs(cfg, (DP,)))
    return jax.shard_map(body, in_specs=(specs,), out_specs=specs, axis_names={DP})(tree)


def shard(stacked: Any, cfg: LlamaConfig, size: int) -> Any:
    """Each replica's chunk (replica % `size`) of its copy's 'embed' axes: [replicas, ..., embed / size, ...]."""
    def body(tree):
        me = lax.axis_index(DP) % size

        def one(x, axis):
            if axis < 0:  # whole on every replica
                return x
            width = x.shape[axis + 1] // size
            return lax.dynamic_slice_in_dim(x, me * width, width, axis + 1)
        return jax.tree.map(one, tree, embed_axes(cfg))
    return _over_dp(body, cfg, stacked)


def gather(chunks: Any, cfg: LlamaConfig, size: int) -> Any:
    """The group's whole copy on each of its replicas, from their chunks (the ring's all-gather)."""
    def body(tree):
        return jax.tree.map(lambda x, axis: x if axis < 0 else groups.group_gather(x[0], size, axis)[None], tree,
                            embed_axes(cfg))
    return _over_dp(body, cfg, chunks)


def group_norms(grads: Any, size: int, cfg: LlamaConfig) -> jax.Array:
    """[replicas]: the global norm of each replica's group gradient, from the chunks' squared norms (a leaf kept
    whole is on each of the group's replicas: counted once)."""
    axes = embed_axes(cfg)
    kept = jax.tree.map(lambda g, axis: g / math.sqrt(size) if axis < 0 else g, grads, axes)
    squares = overlap.waits(jax.vmap(lambda g: optax.tree.norm(g, squared=True))(kept))
    total = jnp.sum(squares.reshape(-1, size), axis=1)
    return jnp.repeat(jnp.sqrt(total), size)


def clip(grads: Any, norms: jax.Array, max_norm: float) -> Any:
    """optax.clip_by_global_norm's rule on each replica's chunk, with its group's norm."""
    def one(g, norm):
        return jax.tree.map(lambda t: lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm), g)
    return jax.vmap(one)(grads, norms)


def fresh(params: Any, inner: optax.GradientTransformation, replicas: int, cfg: LlamaConfig, size: int,
          zero: int) -> dict[str, Any]:
    """Every group at `params`, a fresh inner state of each replica's chunk; under ZeRO-3 chunked parameters."""
    whole = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *p.shape)), params)
    mine = shard(whole, cfg, size)
    return {"params": mine if zero >= 3 else whole, "opt_state": jax.vmap(inner.init)(mine)}


def inner_step(diloco: Any, local: Any, batch: Any) -> tuple[Any, jax.Array, jax.Array, dict]:
    """`DiLoCo.inner_step` with the group's state sharded over its replicas (the module's docstring)."""
    size, cfg, zero = diloco.group_size(), diloco.strategy.spec.cfg, diloco.tc.zero
    whole = local["params"] if zero < 3 else gather(local["params"], cfg, size)
    loss, grads, router = diloco.strategy.per_replica_loss_and_grads(whole, batch, size, scatter=True)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    loads, grads = bias_balance.split_loads(grads)  # a bias is kept whole: its loads are the group's
    norms = group_norms(grads, size, cfg)
    if diloco.tc.grad_clip > 0:  # the inner optimizer's own clip node is an identity (`optim.make_optimizer`)
        grads = clip(grads, norms, diloco.tc.grad_clip)
    mine = shard(local["params"], cfg, size) if zero < 3 else local["params"]
    updates, opt_state = jax.vmap(diloco.inner.update)(grads, local["opt_state"], mine)
    mine = diloco.moved(optax.apply_updates(mine, updates), mine, loads)
    params = gather(mine, cfg, size) if zero < 3 else mine
    return {"params": params, "opt_state": opt_state}, loss, jnp.mean(norms), router
