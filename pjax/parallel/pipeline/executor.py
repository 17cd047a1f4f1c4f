"""The pipeline executor: any schedule table run by one `lax.scan` over ticks inside `jax.shard_map`, manual over pp
(and dp, cp unless ZeRO-3 splits the parameters); the shared parameters' gradients are summed over pp at the end."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh.mesh import CP, DATA, PP, TP, current
from mesh.rules import auto_size, constrain
from models import fp8_weights
from models.moe import ROUTER_METRICS
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.buffers import buffer_plan
from pjax.parallel.pipeline.slot_splits import slot_splits
from pjax.parallel.pipeline.slots import SlotPool
from pjax.parallel.pipeline.stage import Activation, Stage, VjpLayout, varying
from pjax.parallel.pipeline.table import executor_table, send_patterns
from pjax.parallel.pipeline.tick import Batch, Buffers, Plan, tick

__all__ = ["Batch", "executor"]


def executor(sched: ps.Schedule, stage: Stage, lockstep: bool = False,
             reduce: Callable[[Any], Any] | None = lambda g: g) -> tuple[Callable, np.ndarray]:
    """The shard_map body running `sched`, and the table it reads. `lockstep`: one kind of op per tick (cp > 1);
    `reduce` sums the gradients over the manual data axes; None: forwards only, no gradients."""
    table = executor_table(sched, lockstep)

    def body(params: Any, batch: Batch, table: jax.Array) -> tuple[jax.Array, Any, dict]:
        plan = _plan(sched, stage, lockstep, params, batch)
        end, _ = lax.scan(functools.partial(tick, plan), _start(plan, buffer_plan(sched).slots), table[:, 0])
        loss, router = _totals(plan, end)
        return loss, {} if reduce is None else reduce(_gradients(plan, end)), router

    return body, table


def _plan(sched: ps.Schedule, stage: Stage, lockstep: bool, params: Any, batch: Batch) -> Plan:
    device = lax.axis_index(PP)
    mesh = current()
    # Cast to pp-varying, else a replicated weight's gradient would psum inside the loops. ZeRO's shared
    # parameters are gathered over dp here, once per step: left to XLA inside the ticks, they trip its partitioner.
    shared, batch = _unzero(stage, varying({k: a for k, a in params.items() if k != "layers"})), varying(batch)
    # Cast once per step outside the VJP, so that the residuals never hold per-micro-batch copies of the weights.
    # fp8 weights are quantized here too, once per step, for every micro-batch's GEMMs (models/fp8_weights.py).
    by_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(sched.v, -1, *a.shape[1:]), tree)  # noqa: E731
    layers = varying(fp8_weights.with_stacks(stage.precision.cast_layer_weights(by_chunk(params["layers"])),
                                             by_chunk(stage.quantize(params["layers"]))))
    _, b, t = batch["inputs"].shape
    x0 = varying(jnp.zeros((b * t, shared["embed"]["embedding"].shape[1]), stage.precision.embedding))
    nothing = (x0, stage.no_stats())
    taps = (stage.per_layer(varying(stage.taps(_chunk(layers, 0), b * t))),) if sched.split_backward else ()
    w0 = stage.per_layer(_chunk(layers, 0))
    layout = VjpLayout.trace(lambda w, act, *taps: stage.layers(w, act, batch["positions"][0], *taps),
                             w0, nothing, *taps)
    x_sets, dy_sets = send_patterns(sched)
    stage_of = np.array([[sched.stage(s, c) for c in range(sched.v)] for s in range(sched.p)], np.int32)
    return Plan(stage=stage, stage_of=stage_of, stages=sched.p * sched.v, device=device, batch=batch, shared=shared,
                layers=layers, nothing=nothing, taps=taps, layout=layout,
                pool=_slot_pool(stage, layout, w0, nothing, batch, taps), x_sets=x_sets, dy_sets=dy_sets,
                lockstep=lockstep, ordered=lockstep or any(auto_size(mesh, a) > 1 for a in (*DATA, CP, TP)))


def _slot_pool(stage: Stage, layout: VjpLayout, w0: Any, nothing: Activation, batch: Batch, taps: tuple) -> SlotPool:
    """A slot holds a forward's residuals (kind 0), then the taps' (x, g) until W (kind 1)."""
    kept = layout.passed_through(lambda res: layout.unpack(w0, res)(nothing)[2:]) if taps else ()
    stash = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(taps))
    pool = SlotPool((layout.stored, stash), kept, separate=auto_size(current(), TP) > 1)
    if taps and pool.separate:
        pool = dataclasses.replace(pool, splits=slot_splits(stage, pool, w0, nothing, batch["positions"][0], taps[0]))
    return pool


def _start(plan: Plan, slots: int) -> Buffers:
    """Zeros, cast to pp-varying as the ticks' results are: the scan's carry must type alike."""
    x0, stats = plan.nothing
    inbox = lambda: (constrain(_rows(x0, slots + 1), (None, plan.stage.tokens, "embed")), _rows(stats, slots + 1))
    router = {k: jnp.zeros(()) for k in ROUTER_METRICS} if stats else {}
    acc = plan.stage.precision.grad_accum
    return Buffers(inbox=inbox(), cotangents=inbox(),
                   slots=varying(plan.pool.zeros(slots + 1 if plan.lockstep else slots)),  # lockstep: a discard slot
                   grad_layers=_zeros(fp8_weights.split_stacks(plan.layers)[0], acc),
                   grad_head=_zeros(plan.head(plan.shared), acc),
                   loss=varying(jnp.zeros(())), router=_zeros(router),
                   d_embedded=_rows(x0, plan.batch["inputs"].shape[0] + 1))


def _totals(plan: Plan, end: Buffers) -> tuple[jax.Array, dict]:
    """The loss and the router metrics' mean over micro-batches, summed over pp and the manual data axes."""
    data = tuple(a for a in (*DATA, CP) if a in current().manual_axes)
    # The metrics are the whole batch's on every data device: summed there too and divided, they are invariant.
    copies = plan.batch["inputs"].shape[0] * math.prod(lax.axis_size(a) for a in data)
    router = jax.tree.map(lambda r: r / copies, lax.psum(end.router, (PP, *data)))
    return lax.psum(end.loss, (PP, *data)), router


def _gradients(plan: Plan, end: Buffers) -> dict:
    """This device's layer gradients, shared ones summed over pp; the embedding's by one VJP for all micro-batches."""
    m = plan.batch["inputs"].shape[0]
    embed_all = lambda e: jax.vmap(lambda tokens: plan.stage.embed({"embed": e}, tokens))(plan.batch["inputs"])
    d_embed = jax.vjp(embed_all, plan.shared["embed"])[1](end.d_embedded[:m])[0]
    gs = end.grad_head
    gs = {**gs, "embed": jax.tree.map(lambda g, d: g + d.astype(jnp.float32), gs["embed"], d_embed)
          if "embed" in gs else jax.tree.map(lambda d: d.astype(jnp.float32), d_embed)}
    return {**lax.psum(_unzero(plan.stage, gs), PP),
            "layers": jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), end.grad_layers)}


def _unzero(stage: Stage, tree: Any) -> Any:
    return jax.tree.map(lax.with_sharding_constraint, tree, stage.shared_specs)


def _chunk(layers: Any, c: int) -> Any:
    return jax.tree.map(lambda a: a[c], layers)


def _rows(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda a: varying(jnp.zeros((n, *a.shape), a.dtype)), tree)


def _zeros(tree: Any, dtype: Any = jnp.float32) -> Any:
    return varying(jax.tree.map(lambda a: jnp.zeros(a.shape, dtype), tree))
