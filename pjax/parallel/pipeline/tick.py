"""One tick of the pipeline executor on one device: forward, loss, backward, weight, send, each where the table says."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh.mesh import PP
from mesh.rules import constrain
from models import fp8_weights
from pjax.parallel.pipeline import schedules as ps
from pjax.parallel.pipeline.slots import SlotPool
from pjax.parallel.pipeline.stage import Activation, Stage, VjpLayout
from pjax.parallel.pipeline.table import COLUMNS, LANE_COLUMNS, scope_name, send_scope

Batch = dict[str, jax.Array]


class Buffers(NamedTuple):
    """What the scan over ticks carries on one device (S: the schedule's slots)."""

    inbox: Activation         # arriving activations by slot, [S + 1, ...]: row S is "nothing came"
    cotangents: Activation
    slots: dict               # by slot, a forward's VJP residuals, then what B leaves W (`pipeline/slots.py`)
    grad_layers: Any          # fp32 [v, layers per chunk, ...]
    grad_head: Any
    loss: jax.Array
    router: dict
    d_embedded: jax.Array     # [m + 1, B*T, D]: the embedding's cotangent per micro-batch (+ a discard row)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every tick of one trace reads (`executor._plan`)."""

    stage: Stage
    stage_of: np.ndarray      # [device, chunk] -> model stage
    stages: int
    device: jax.Array
    batch: Batch
    shared: dict
    layers: Any
    nothing: Activation       # zeros: what a device sends on a tick without that op
    taps: tuple               # zero-bubble: (the zero taps of a chunk's layers,); else ()
    layout: VjpLayout
    pool: SlotPool
    x_sets: list              # per lane, the sets of (sender, receiver) pairs an activation goes by
    dy_sets: list
    lockstep: bool
    ordered: bool             # the tick's compute holds collectives: transfers one at a time, after it

    @property
    def split(self) -> bool:
        return bool(self.taps)

    def chunk(self, c: Any) -> Any:
        return jax.tree.map(lambda a: a[c], self.layers)

    def head(self, tree: dict) -> dict:
        return {k: tree[k] for k in self.stage.head_keys}

    def at(self, entry: jax.Array) -> Row:
        op, mb, c, slot, active = (entry[i] for i in range(len(COLUMNS)))
        lanes = entry[len(COLUMNS):].reshape(len(self.x_sets), len(LANE_COLUMNS))
        j = jnp.asarray(self.stage_of)[self.device, c]
        first, last = j == 0, j == self.stages - 1
        micro = {k: a[mb] for k, a in self.batch.items()}
        w = self.stage.per_layer(self.chunk(c))
        return Row(op, mb, c, slot, active, lanes, first, last, micro, w, self.lockstep)


class Row(NamedTuple):
    """This tick's entry of the table on this device (`table.executor_table`), and what it picks."""

    op: jax.Array
    mb: jax.Array
    chunk: jax.Array
    slot: jax.Array
    active: jax.Array
    lanes: jax.Array
    first: jax.Array
    last: jax.Array
    micro: Batch
    w: Any
    lockstep: bool

    def keep(self, d: jax.Array) -> jax.Array:
        return jnp.where(self.active > 0, d, jnp.zeros_like(d)) if self.lockstep else d

    def add(self, acc: Any, d: Any) -> Any:
        return jax.tree.map(lambda a, x: a + self.keep(x).astype(a.dtype), acc, d)  # a bf16 accumulator stays bf16


def tick(plan: Plan, buf: Buffers, entry: jax.Array) -> tuple[Buffers, None]:
    row = plan.at(entry)
    buf, x = forward(plan, row, buf)
    buf, x = loss(plan, row, buf, x)
    buf, dy = backward(plan, row, buf)
    buf, sends = weight(plan, row, buf, [x, dy])
    return send(plan, row, buf, sends), None


def _run_if(pred: jax.Array, fn: Callable[[Any], Any], state: Any) -> Any:
    """`fn(state)` where `pred` holds, else `state`: a while loop of 0 or 1 trips, which updates its carry
    in place where `lax.cond` copies (ARCHITECTURE.md, "Pipeline schedules as data, one SPMD program")."""
    def body(carry):
        _, state = carry
        return jnp.zeros_like(pred), fn(state)

    return lax.while_loop(lambda carry: carry[0], body, (pred, state))[1]


def receive(plan: Plan, row: Row, inbox: Activation) -> Activation:
    """The activation a forward runs on: stage 0 embeds its micro-batch, the others take what arrived."""
    embed = _scoped("embed", lambda: (plan.stage.embed(plan.shared, row.micro["inputs"]), plan.stage.no_stats()))
    arrived = lambda: (constrain(inbox[0][row.slot], (plan.stage.tokens, "embed")), _at(inbox[1], row.slot))
    return lax.cond(row.first, embed, arrived)


def forward(plan: Plan, row: Row, buf: Buffers) -> tuple[Buffers, Activation]:
    """F: keeps the VJP's residuals in the slot until B; returns what goes to the next stage."""
    def run(state):
        pooled, _ = state
        layers = lambda w, act, *taps: plan.stage.layers(w, act, row.micro["positions"], *taps)
        out, vjp_fn = jax.vjp(layers, row.w, receive(plan, row, buf.inbox), *plan.taps)
        return plan.pool.write(pooled, row.slot, 0, plan.layout.pack(vjp_fn)), out

    slots, x = _run_if(row.op == ps.FORWARD, _scoped("forward", run), (buf.slots, plan.nothing))
    return buf._replace(slots=slots), x


def loss(plan: Plan, row: Row, buf: Buffers, x: Activation) -> tuple[Buffers, Activation]:
    """The last stage's head after its forward: loss, head gradients, and the cotangent B reads from the
    slot. In a loop of its own, not the forward's (ARCHITECTURE.md, "Zero-bubble memory: one slot from arrival to W")."""
    def run(state):
        cotangents, grad_head, total, router, act = state
        fn = lambda head, act: plan.stage.loss({**plan.shared, **head}, act, row.micro["labels"])
        (l, metrics), (dhead, dact) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(plan.head(plan.shared), act)
        cotangents, grad_head = _put(cotangents, row.slot, dact), row.add(grad_head, dhead)
        return cotangents, grad_head, total + row.keep(l), row.add(router, metrics), act

    state = (buf.cotangents, buf.grad_head, buf.loss, buf.router, x)
    cotangents, grad_head, total, router, x = _run_if((row.op == ps.FORWARD) & row.last, _scoped("loss", run), state)
    return buf._replace(cotangents=cotangents, grad_head=grad_head, loss=total, router=router), x


def backward(plan: Plan, row: Row, buf: Buffers) -> tuple[Buffers, Activation]:
    """B: adds the chunk's weight gradients; returns the activation's cotangent (stage 0 keeps it for the
    embedding, differentiated after the scan). Reads the slots as the forward's loop left them, else XLA copies them."""
    def run(state):
        grad_layers, d_embedded, pooled, _ = state
        dw, dact, *dtaps = plan.layout.unpack(row.w, plan.pool.read(pooled, row.slot, 0))(_at(buf.cotangents, row.slot))
        pooled = _leave_for_weight(plan, row, pooled, dw, dact, dtaps)
        grad_layers = jax.tree.map(lambda g, d: g.at[row.chunk].add(row.keep(d).astype(g.dtype)), grad_layers,
                                   fp8_weights.split_stacks(plan.stage.stacked(dw))[0])
        discard = plan.batch["inputs"].shape[0]
        d_embedded = d_embedded.at[jnp.where(row.first & (row.active > 0), row.mb, discard)].set(dact[0])
        return grad_layers, d_embedded, pooled, dact

    state = (buf.grad_layers, buf.d_embedded, buf.slots, plan.nothing)
    grad_layers, d_embedded, slots, dy = _run_if(row.op == ps.BACKWARD, _scoped("backward", run), state)
    return buf._replace(grad_layers=grad_layers, d_embedded=d_embedded, slots=slots), dy


def _leave_for_weight(plan: Plan, row: Row, pooled: dict, dw: Any, dact: Activation, dtaps: list) -> dict:
    """Zero-bubble: B leaves W the taps' cotangents, written over the residuals it has just read (`_finite_start`)."""
    if not plan.split:
        return pooled
    gs = [jax.tree.leaves(dtaps[0])[i] for i in plan.pool.written(1)]
    return _run_if(_finite_start(dw, dact), lambda pooled: plan.pool.write(pooled, row.slot, 1, gs), pooled)


def _finite_start(*trees: Any) -> jax.Array:
    """Whether every leaf's first element is a number: a trip count that orders B's writes after its reads."""
    firsts = [jnp.ravel(a)[0].astype(jnp.float32) for a in jax.tree.leaves(trees)]
    return ~jnp.isnan(sum(firsts))


def weight(plan: Plan, row: Row, buf: Buffers, sends: list) -> tuple[Buffers, list]:
    """W: the projections' weight gradients from the (x, g) B left; with `plan.ordered` the sends ride its loop."""
    if not plan.split:
        return buf, sends

    def run(state):
        grad_layers, riders = state
        taps = jax.tree.unflatten(jax.tree.structure(plan.taps[0]), plan.pool.read(buf.slots, row.slot, 1))
        dw = plan.stage.weight_grads(taps, plan.chunk(row.chunk))
        return {k: g.at[row.chunk].add(dw[k].astype(g.dtype)) if k in dw else g for k, g in grad_layers.items()}, riders

    riders = sends if plan.ordered else []
    # Only where active: a W holds no collective, so in lockstep (cp > 1) a device without one skips it.
    grad_layers, riders = _run_if((row.op == ps.WEIGHT) & (row.active > 0), _scoped("weight", run),
                                  (buf.grad_layers, riders))
    return buf._replace(grad_layers=grad_layers), riders if plan.ordered else sends


def send(plan: Plan, row: Row, buf: Buffers, sends: list) -> Buffers:
    """Per lane, `sends` (activation, cotangent) to the next and previous stage, after the compute: a collective in a
    loop completes only where its whole group runs the loop, which a pp permute's group would not (see `_run_if`)."""
    inbox, cotangents = buf.inbox, buf.cotangents
    for lane, (recv_x, recv_dy, send_x, send_dy) in enumerate(row.lanes):
        sends, got_x = _permute(plan, sends, 0, send_x, plan.x_sets[lane], "x", lane)
        sends, got_dy = _permute(plan, sends, 1, send_dy, plan.dy_sets[lane], "dy", lane)
        inbox, cotangents = _put(inbox, recv_x, got_x), _put(cotangents, recv_dy, got_dy)
    return buf._replace(inbox=inbox, cotangents=cotangents)


def _permute(plan: Plan, sends: list, i: int, which: jax.Array, sets: list, kind: str, lane: int) -> tuple[list, Any]:
    """`sends[i]` sent by the permute of set `which` (0: none) of this lane's `sets`: (sends, arrived).
    `plan.ordered`: one collective at a time (ARCHITECTURE.md, "Pipelines on forced CPU devices")."""
    state = [*sends, sends[i]] if plan.ordered else [sends[i]]
    for k, pairs in enumerate(sets, 1):
        state = _run_if(which == k, _scoped(send_scope(kind, lane, k), _send_at(len(state) - 1, pairs)), state)
    return (state if plan.ordered else sends), state[-1]


def _send_at(i: int, pairs: tuple) -> Callable[[list], list]:
    def send_one(state):
        sent = jax.tree.map(lambda a: lax.ppermute(a, PP, list(pairs)), state[i])
        return [*state[:i], sent, *state[i + 1:]]
    return send_one


def _scoped(part: str, fn: Callable) -> Callable:
    """`fn` under the named scope `table.scope_name(part)`, kept in XLA's op names (`table.scope_runs`)."""
    def scoped(*args):
        with jax.named_scope(scope_name(part)):
            return fn(*args)
    return scoped


def _at(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def _put(tree: Any, i: jax.Array, value: Any) -> Any:
    return jax.tree.map(lambda a, x: a.at[i].set(x), tree, value)
