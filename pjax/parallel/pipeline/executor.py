"""The pipeline executor: any schedule table run by one scan over ticks inside `jax.shard_map`.

The schedule is data (`pipeline/schedules.py`: tick x device -> forward / backward / weight
gradients / idle), the executor is a `lax.scan` over ticks inside `jax.shard_map`, and a tick's
transfers are `ppermute`s holding only the pairs that carry something that tick (`pipeline/table.py`;
two lanes where a device can receive two activations in one tick, `pipeline/buffers.py`). AFAB,
1F1B, interleaved 1F1B, ZB-H1 and ZB-V are the same program with different tables. The shard_map
is manual over pp (`pipeline/step.py` sets it up), and over the data axes dp and cp too
unless parameters are ZeRO-3 split (`data_parallel.can_reduce_once`): then
each device accumulates its own rows' gradients through every tick and they are reduced once,
after the scan; otherwise dp stays automatic and XLA reduces each tick's gradients. tp
shardings keep working inside a stage either way.

Where things live
* Device s holds the stacked 'layers' parameters [s*L/p, (s+1)*L/p): the 'layers' dim is split
  over pp (`mesh.rules.param_rules(pipelined=True)`); with v chunks per device the stack is kept
  in pipeline order, round robin or in a V (`pipeline/layout.py`).
* The embedding, final norm and output layer are replicated over pp (the parameter tree does not
  change with pp) and used only by the first / last model stage. The last stage's forward adds
  to the final norm and output layer gradients; the first stage keeps each micro-batch's
  embedding cotangent, and the embedding is differentiated once, after the scan. These
  gradients are summed over pp once, at the end.

One tick on one device: run the forward if the table says so (the embedding first on the
first stage, the loss and the start of the backward on the last), then the backward if it says
so, then pass activations to the next stage's device and cotangents to the previous stage's
(an activation is the hidden states and, for a Mixture-of-Experts model, the router statistics
so far: `pipeline/stage.py` says why they travel). A zero-bubble table
(`pipeline/zero_bubble.py`) also has W items:
its backward (B) then leaves the projections' weight gradients to a later W, storing what W
needs in the micro-batch's slot over the residuals B has read (`models/deferred_grads.py` says
what, `pipeline/slots.py` how). A forward keeps its
VJP residuals (the leaves of `jax.vjp`'s function, minus the weights) in a slot buffer until its
backward, so a device holds as many micro-batches as the schedule keeps in flight: p for 1F1B,
2p - 1 for lockstep 1F1B, m for AFAB. `train.remat` shrinks the residuals (remat='full' keeps
only each layer's input).

"Run if" is a while loop of zero or one trips (`_run_if`), not `lax.cond`/`lax.switch`: XLA
gives a conditional's result buffers of their own, so every buffer a branch passes through or
updates (the residual slots, the inboxes, the gradient accumulators) is copied each tick,
where a while loop updates its carry in place (benchmarks/README.md has the step times of both).

Pitfalls. A collective inside a forward or backward must only involve
devices that run it: the tp/dp all-reduces XLA inserts are fine (their groups share a pp
index), but one HLO collective-permute spans every stage, so both transfers run after them.
Ring attention (cp > 1) has its permutes inside the forward and backward, so then every device
must run the same kind of op each tick: the table is run in lockstep (`ps.lockstep`), a device
with no work of the tick's kind computing on a discard slot, its results masked. Fresh zeros
and replicated parameters are cast to pp-varying first, or the loop and scan types differ and
the gradient of a replicated weight would psum inside the loop. XLA compiles both loop bodies
and gives their temporaries memory whichever a tick runs.
The loss is seeded with 1/(tokens in the global batch), so the gradient is that of the mean
over all micro-batches (Picotron's PP path forgets the 1/m).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh.errors import ConfigError
from mesh.mesh import CP, DP, PP, TP
from mesh.rules import auto_size, constrain
from models.moe import ROUTER_METRICS
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.buffers import buffer_plan
from pjax.parallel.pipeline.stage import Activation, Stage, VjpLayout, varying
from pjax.parallel.pipeline.table import COLUMNS, LANE_COLUMNS, executor_table, scope_name, send_patterns, send_scope
from pjax.parallel.pipeline.slots import SlotPool
from pjax.parallel.pipeline.slot_splits import slot_splits

Batch = dict[str, jax.Array]


# --- One tick: a forward and a backward that run or not ---------------------------------------------

def _run_if(pred: jax.Array, fn: Callable[[Any], Any], state: Any) -> Any:
    """`fn(state)` where `pred` holds, else `state` as it is: a while loop of 0 or 1 trips.

    Not `lax.cond`: XLA gives a conditional's result a buffer of its own and copies into it every
    buffer a branch passes through or updates (the residual slots, the gradient accumulators:
    tens of MB per tick), where a while loop updates its carry in place.
    """
    def body(carry):
        _, state = carry
        return jnp.zeros_like(pred), fn(state)

    return lax.while_loop(lambda carry: carry[0], body, (pred, state))[1]


def _finite_start(*trees: Any) -> jax.Array:
    """Whether the first element of every leaf of `trees` is a number (not NaN): True but in a
    step whose gradients are NaN anyway.

    B writes what it leaves W over the residuals it has read, in place, by a loop that runs if
    this holds of B's results: XLA runs a loop after whatever its trip count depends on, so the
    writes come after every read of the slot. Unordered, XLA copies the whole slot buffer to
    keep the reads safe; staged in a buffer of their own and written by a loop after B's, the
    output cotangents cost one micro-batch's worth more memory for the whole step.
    """
    firsts = [jnp.ravel(a)[0].astype(jnp.float32) for a in jax.tree.leaves(trees)]
    return ~jnp.isnan(sum(firsts))


# --- The executor: a scan over ticks inside shard_map -----------------------------------------------

class Buffers(NamedTuple):
    """What the scan over ticks carries on one device (shapes per device; S = schedule slots)."""

    inbox: Activation         # arriving activations by slot: ([S + 1, B*T, D], stats [S + 1, ...]); S = "nothing came"
    cotangents: Activation    # arriving cotangents by slot, the same shapes
    slots: dict               # by slot, each forward's VJP residuals, then (B and W split) what B leaves its W (`pipeline/slots.py`)
    grad_layers: Any          # fp32 [v, layers per chunk, ...]: this device's layer gradients
    grad_head: Any            # fp32: final norm and output layer gradients (the last stage's)
    loss: jax.Array           # []: the losses computed here
    router: dict              # MoE: the router metrics of the micro-batches whose loss ran here, summed
    d_embedded: jax.Array     # [m + 1, B*T, D]: the embedding's cotangent per micro-batch (+ a discard row)


def _at(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def _put(tree: Any, i: jax.Array, value: Any) -> Any:
    return jax.tree.map(lambda a, x: a.at[i].set(x), tree, value)


def _send(tree: Any, perm: list[tuple[int, int]]) -> Any:
    return jax.tree.map(lambda a: lax.ppermute(a, PP, perm), tree)


def _send_at(i: int, pairs: tuple) -> Callable[[list], list]:
    """Send `state[i]` by one permute of `pairs`; the rest of `state` rides along unchanged."""
    return lambda state: [*state[:i], _send(state[i], list(pairs)), *state[i + 1:]]


def _lane_sends(state: list, i: int, which: jax.Array, sets: list, kind: str, lane: int) -> list:
    """`state` after the permute of set `which` (0: none) of this lane's `sets` has sent `state[i]`."""
    for k, pairs in enumerate(sets, 1):
        state = _run_if(which == k, _scoped(send_scope(kind, lane, k), _send_at(i, pairs)), state)
    return state


def _scoped(part: str, fn: Callable) -> Callable:
    """`fn` under the name `table.scope_name(part)`, which XLA keeps in the op names of
    its collectives (for `scope_runs`' accounting)."""
    def scoped(*args):
        with jax.named_scope(scope_name(part)):
            return fn(*args)
    return scoped


def executor(sched: ps.Schedule, stage: Stage, lockstep: bool = False,
             reduce: Callable[[Any], Any] | None = lambda g: g) -> tuple[Callable, np.ndarray]:
    """The shard_map body running `sched`, and the table it reads (`table.executor_table`).

    In lockstep (`ps.lockstep`), `op` is the tick's one kind of op on every device, and a device
    with nothing to do runs it anyway on the discard slot, its results masked by `active`; that
    keeps collectives inside the forward and backward (ring attention's) in step across the stages.
    `reduce` sums the gradients over the data axes at the end when they are manual (see `_run`);
    None: a forwards-only table, whose body returns no gradients (`{}`) and reduces none.
    """
    p, v, n_slots = sched.p, sched.v, buffer_plan(sched).slots
    split = sched.split_backward  # zero-bubble: B computes input gradients, W the projections' dW
    if split and lockstep:  # tables of your own (the config's: validate_split_backward)
        raise ConfigError(f"schedule {sched.name} splits backwards into B and W, which does not run with cp > 1 "
                          f"yet; use pipeline.schedule=1f1b.")
    table = executor_table(sched, lockstep)
    # Per transfer lane, one permute per set of (sender, receiver) pairs (`pipeline/buffers.py`).
    x_sets, dy_sets = send_patterns(sched)
    stages = np.array([[sched.stage(s, c) for c in range(v)] for s in range(p)], np.int32)  # device, chunk -> stage

    def body(params: Any, batch: Batch, table: jax.Array) -> tuple[jax.Array, Any, dict]:
        device = lax.axis_index(PP)
        # A thread waiting in a collective blocks (XLA:CPU): with collectives in the tick's compute
        # (tp, dp or cp left to XLA, ring attention in lockstep), a transfer waiting beside them could
        # leave every thread waiting (ARCHITECTURE.md, "Pipelines on forced CPU devices").
        ordered = lockstep or any(auto_size(jax.sharding.get_abstract_mesh(), a) > 1 for a in (DP, CP, TP))
        # The embedding and output layer are used by whole ticks: under ZeRO they are gathered over
        # dp once per step here (and their gradients reduce-scattered after), not in every tick.
        # (Leaving their dp split to XLA inside the ticks also trips its SPMD partitioner.)
        unzero = lambda t: jax.tree.map(lax.with_sharding_constraint, t, stage.shared_specs)
        shared, batch = unzero(varying({k: a for k, a in params.items() if k != "layers"})), varying(batch)
        head_of = lambda tree: {k: tree[k] for k in stage.head_keys}
        # This device's [v * layers_per_chunk, ...] -> [v, layers_per_chunk, ...], cast once per step
        # outside the VJP so the residuals never hold per-micro-batch copies of the weights.
        layers = jax.tree.map(lambda a: varying(a.reshape(v, -1, *a.shape[1:]).astype(stage.dtype)), params["layers"])
        chunk = lambda c: jax.tree.map(lambda a: a[c], layers)
        m, b, t = batch["inputs"].shape
        x0 = varying(jnp.zeros((b * t, shared["embed"]["embedding"].shape[1]), stage.dtype))  # [B*T, D]
        nothing = (x0, stage.no_stats())  # what a device sends on a tick without that op
        taps = (stage.per_layer(varying(stage.taps(chunk(0), b * t))),) if split else ()  # models/deferred_grads.py
        w0 = stage.per_layer(chunk(0))
        layout = VjpLayout.trace(lambda w, act, *taps: stage.layers(w, act, batch["positions"][0], *taps),
                                 w0, nothing, *taps)
        rows = lambda tree, n: jax.tree.map(lambda a: varying(jnp.zeros((n, *a.shape), a.dtype)), tree)
        inbox = lambda: (constrain(rows(x0, n_slots + 1), (None, stage.tokens, "embed")), rows(nothing[1], n_slots + 1))
        f32_zeros = lambda tree: varying(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree))
        res_slots = n_slots + 1 if lockstep else n_slots  # lockstep: idle devices write a discard slot
        # A slot holds a forward's residuals (kind 0) until its backward, then the taps' (x, g) per
        # layer (kind 1) until its W: one buffer per dtype as large as the larger, or with tp > 1
        # a buffer per leaf, which keeps its tp split, B's g's taking over residuals' buffers split
        # alike (pipeline/slots.py, pipeline/slot_splits.py).
        stash = jax.tree.leaves(taps)
        # The taps' x's B passes through from the residuals stay where the forward put them.
        kept = layout.passed_through(lambda res: layout.unpack(w0, res)(nothing)[2:]) if split else ()
        pool = SlotPool((layout.stored, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stash)), kept,
                        separate=auto_size(jax.sharding.get_abstract_mesh(), TP) > 1)
        if split and pool.separate:
            splits = slot_splits(stage, pool, w0, nothing, batch["positions"][0], taps[0])
            pool = dataclasses.replace(pool, splits=splits)
        tap_tree = jax.tree.structure(taps[0]) if split else None
        router0 = {k: jnp.zeros(()) for k in ROUTER_METRICS} if nothing[1] else {}  # (MoE: stats not ())
        start = Buffers(inbox=inbox(), cotangents=inbox(), slots=varying(pool.zeros(res_slots)),
                        grad_layers=f32_zeros(layers), grad_head=f32_zeros(head_of(shared)),
                        loss=varying(jnp.zeros(())),
                        router=f32_zeros(router0), d_embedded=rows(x0, m + 1))

        def tick(buf: Buffers, row: jax.Array) -> tuple[Buffers, None]:
            op, mb, c, slot, active = (row[i] for i in range(len(COLUMNS)))
            lanes = row[len(COLUMNS):].reshape(len(x_sets), len(LANE_COLUMNS))
            j = jnp.asarray(stages)[device, c]
            first, last = j == 0, j == p * v - 1
            micro = {k: a[mb] for k, a in batch.items()}
            w = stage.per_layer(chunk(c))
            # Only lockstep has devices running an op without work: their results are dropped.
            keep = (lambda d: jnp.where(active > 0, d, jnp.zeros_like(d))) if lockstep else (lambda d: d)
            add = lambda acc, d: jax.tree.map(lambda a, x: a + keep(x), acc, d)

            def head(state):  # the last model stage starts the backward itself: loss, dhead and dact
                cotangents, grad_head, loss, router, act = state
                loss_fn = lambda hp, act: stage.loss({**shared, **hp}, act, micro["labels"])
                (l, metrics), (dhead, dact) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                    head_of(shared), act)
                return _put(cotangents, slot, dact), add(grad_head, dhead), loss + keep(l), add(router, metrics), act

            def forward(state):  # keeps the VJP residuals at the slot; stage 0 embeds first
                pooled, _ = state
                # Both branches sharded alike; the router statistics start at zero on the first stage.
                embed = _scoped("embed", lambda: (stage.embed(shared, micro["inputs"]), stage.no_stats()))
                act = lax.cond(first, embed,
                               lambda: (constrain(buf.inbox[0][slot], (stage.tokens, "embed")), _at(buf.inbox[1], slot)))
                out, vjp_fn = jax.vjp(lambda w, act, *taps: stage.layers(w, act, micro["positions"], *taps),
                                      w, act, *taps)
                return pool.write(pooled, slot, 0, layout.pack(vjp_fn)), out

            def backward(state, cotangents):  # adds the chunk's weight gradients; the
                # activation's cotangent goes one stage back. A tick runs one op, so the forward's
                # writes are never what is read here; but reading the buffers as the forward left
                # them lets XLA update them in place (the buffers from before the forward would have
                # to be kept: XLA copied the residual slots every tick, benchmarks/README.md).
                grad_layers, d_embedded, pooled, _ = state
                dw, dact, *dtaps = layout.unpack(w, pool.read(pooled, slot, 0))(_at(cotangents, slot))
                if split:  # the projections' dW in `dw` are zeros: W computes them from the taps
                    gs = [jax.tree.leaves(dtaps[0])[i] for i in pool.written(1)]
                    pooled = _run_if(_finite_start(dw, dact), lambda pooled: pool.write(pooled, slot, 1, gs), pooled)
                grad_layers = jax.tree.map(lambda g, d: g.at[c].add(keep(d).astype(g.dtype)), grad_layers,
                                           stage.stacked(dw))
                # Stage 0 keeps the embedding's cotangent: the embedding is differentiated once,
                # for all micro-batches, after the scan.
                d_embedded = d_embedded.at[jnp.where(first & (active > 0), mb, m)].set(dact[0])
                return grad_layers, d_embedded, pooled, dact

            def weight(grad_layers):  # W: the projections' weight gradients from what B left
                dw = stage.weight_grads(jax.tree.unflatten(tap_tree, pool.read(pooled, slot, 1)), chunk(c))
                return {k: g.at[c].add(dw[k]) if k in dw else g for k, g in grad_layers.items()}

            # A collective inside these loops runs only where every device of its group takes the
            # same trip count: tp/dp ones do (their groups share a pp index), a pp transfer would not,
            # so both transfers run after them (and ring attention's only in lockstep).
            pooled, send_act = _run_if(op == ps.FORWARD, _scoped("forward", forward), (buf.slots, nothing))
            # The loss in a loop of its own, after the forward's: its logits are then never alive
            # beside residuals still waiting to be written to the slot (a loop nested in the
            # forward's, XLA can run before the writes).
            cotangents, grad_head, loss, router, send_act = _run_if(
                (op == ps.FORWARD) & last, _scoped("loss", head),
                (buf.cotangents, buf.grad_head, buf.loss, buf.router, send_act))
            grad_layers, d_embedded, pooled, send_cot = _run_if(
                op == ps.BACKWARD, _scoped("backward", lambda state: backward(state, cotangents)),
                (buf.grad_layers, buf.d_embedded, pooled, nothing))
            # The transfers: activations to the next stage's device, cotangents to the previous
            # stage's, on the ticks where some device sends, by the permute of that tick's set of
            # pairs (a number every device agrees on), lane by lane; a device nothing reaches by a
            # lane receives into the "nothing came" slot. When the tick's compute holds collectives
            # too, what the device sends and receives is carried through W's loop and every
            # transfer's: one chain, so that it waits in one collective at a time (`ordered`).
            state = [send_act, send_cot]
            if split and ordered:
                grad_layers, state = _run_if(op == ps.WEIGHT, _scoped("weight", lambda s: (weight(s[0]), s[1])),
                                             (grad_layers, state))
            elif split:
                grad_layers = _run_if(op == ps.WEIGHT, _scoped("weight", weight), grad_layers)
            inbox = buf.inbox
            for lane, (recv_x, recv_dy, send_x, send_dy) in enumerate(lanes):
                if ordered:
                    state = _lane_sends([*state, state[0]], len(state), send_x, x_sets[lane], "x", lane)
                    state = _lane_sends([*state, state[1]], len(state), send_dy, dy_sets[lane], "dy", lane)
                    got_x, got_dy = state[-2], state[-1]
                else:  # each transfer free to start once what it sends is computed
                    got_x = _lane_sends([send_act], 0, send_x, x_sets[lane], "x", lane)[0]
                    got_dy = _lane_sends([send_cot], 0, send_dy, dy_sets[lane], "dy", lane)[0]
                inbox, cotangents = _put(inbox, recv_x, got_x), _put(cotangents, recv_dy, got_dy)
            return Buffers(inbox=inbox, cotangents=cotangents,
                           slots=pooled, grad_layers=grad_layers, grad_head=grad_head, loss=loss,
                           router=router, d_embedded=d_embedded), None

        end, _ = lax.scan(tick, start, table[:, 0])
        data = tuple(a for a in (DP, CP) if a in jax.sharding.get_abstract_mesh().manual_axes)
        # The mean over micro-batches; the statistics are the whole batch's on every data device
        # (summed over dp and cp where computed), so summing over those too and dividing keeps
        # them and makes them invariant there.
        copies = m * math.prod(lax.axis_size(a) for a in data)
        router = jax.tree.map(lambda r: r / copies, lax.psum(end.router, (PP, *data)))
        loss = lax.psum(end.loss, (PP, *data))
        if reduce is None:
            return loss, {}, router
        # The embedding's gradient, once for all micro-batches (zero except on the first stage).
        embed_all = lambda e: jax.vmap(lambda tokens: stage.embed({"embed": e}, tokens))(batch["inputs"])
        d_embed = jax.vjp(embed_all, shared["embed"])[1](end.d_embedded[:m])[0]
        gs = end.grad_head
        gs = {**gs, "embed": jax.tree.map(lambda g, d: g + d.astype(jnp.float32), gs["embed"], d_embed)
              if "embed" in gs else jax.tree.map(lambda d: d.astype(jnp.float32), d_embed)}
        # Replicated parameters: each device holds part of their gradient; sum once, after the scan.
        grads = {**lax.psum(unzero(gs), PP),
                 "layers": jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), end.grad_layers)}
        return loss, reduce(grads), router

    return body, table
