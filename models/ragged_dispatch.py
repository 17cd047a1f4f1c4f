"""Dropless expert parallelism without padding: each device sends each other device exactly the rows routed
to that device's experts (`ragged_all_to_all`), and its grouped GEMMs take exactly the rows it received.

One MoE layer on one device, inside a shard_map manual over the expert axis (n devices, E/n experts each):

1. sort the N*k assignments by expert, so that each destination's rows are one contiguous run;
2. all-gather every device's per-expert counts ([n, E] integers): from them each device computes every send
   size, offset and receive size itself (`ExchangePlan`), with no second round trip;
3. `ragged_all_to_all` the sorted rows; the receive buffer holds them sender-major, each sender's run sorted
   by local expert; sort it once more, expert-major, for `ragged_dot`;
4. the experts' SwiGLU as grouped GEMMs, unsort, `ragged_all_to_all` back, unsort to (token, choice) order.

The receive buffer's rows are a static bound: by default every assignment of every device (n*N*k: nothing
can overflow); `moe.receive_factor` caps it at that many times an even share (N*k). Past the cap a receiver
takes its senders in order, each sender's run cut at its tail; the cut assignments are dropped, counted in
`dropped_fraction`, and pass through the residual.

XLA:CPU has no ragged all-to-all, so on CPU `ragged_all_to_all` is an exact stand-in built from a dense
`all_to_all` (tests/test_ragged_dispatch.py checks it against the operation's documented semantics); on GPUs
the real collective is compiled (tests/test_gpu_target.py reads it in the optimized HLO)."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mesh.backend import target_backend


def receive_rows(tokens: int, top_k: int, devices: int, factor: float | None) -> int:
    """The receive buffer's rows: every device's every assignment (`factor` None), else `factor` times an even
    share of `tokens * top_k`, never more than that bound."""
    bound = devices * tokens * top_k
    return bound if factor is None else max(1, min(bound, math.ceil(factor * tokens * top_k)))


def _exclusive(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


class ExchangePlan(NamedTuple):
    """Both directions of one layer's exchange, as this device's `ragged_all_to_all` arguments ([n] each)."""

    send_offsets: jax.Array  # where my run for device j starts in my sorted rows
    send_sizes: jax.Array  # rows I send device j (its receive cap may cut my run)
    remote_offsets: jax.Array  # where my run lands in device j's receive buffer
    recv_offsets: jax.Array  # where device i's run starts in my receive buffer
    recv_sizes: jax.Array  # rows device i sends me
    runs: jax.Array  # [n, E/n] rows device i sends me for each of my experts: my buffer is these runs in order

    @property
    def group_sizes(self) -> jax.Array:
        """[E/n] rows received per local expert."""
        return jnp.sum(self.runs, axis=0)


def exchange_plan(counts: jax.Array, me: jax.Array, capacity: int) -> ExchangePlan:
    """The plan from every device's per-expert counts `counts` [n, E] (experts in owner order), for device `me`."""
    n, num_experts = counts.shape
    per = counts.reshape(n, n, num_experts // n)  # per[i, j, l]: device i's rows for device j's local expert l
    sizes = jnp.sum(per, axis=-1)  # [i, j]
    # Receiver j fills its buffer sender by sender, up to its capacity.
    taken = jnp.clip(capacity - _exclusive(sizes, axis=0), 0, sizes)
    mine = per[:, me]  # [i, l]: what device i routes to my experts, before the cap
    kept = jnp.clip(taken[:, me, None] - _exclusive(mine), 0, mine)  # a cut run loses its last experts' rows
    return ExchangePlan(send_offsets=_exclusive(sizes[me]), send_sizes=taken[me],
                        remote_offsets=_exclusive(taken, axis=0)[me], recv_offsets=_exclusive(taken[:, me]),
                        recv_sizes=taken[:, me], runs=kept)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, axis: str, max_send: int) -> jax.Array:
    """`lax.ragged_all_to_all` with one slice per device, or on CPU its exact stand-in; `max_send` bounds any
    one slice (the stand-in's dense buffer is [n, max_send, ...])."""
    if target_backend() != "cpu":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)
    return dense_stand_in(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, max_send)


def dense_stand_in(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                   output_offsets: jax.Array, recv_sizes: jax.Array, axis: str, max_send: int) -> jax.Array:
    """`ragged_all_to_all`'s semantics from a dense `all_to_all`: each slice padded to `max_send` rows, sent,
    and written at the offset its sender named (XLA:CPU has no ragged all-to-all)."""
    rows = jnp.arange(max_send)
    take = input_offsets[:, None] + rows
    valid = rows < send_sizes[:, None]
    slabs = jnp.where(valid[..., None], operand[jnp.clip(take, 0, operand.shape[0] - 1)], 0)  # [n, max_send, ...]
    got = lax.all_to_all(slabs, axis, 0, 0, tiled=True)  # got[i]: device i's slice for me
    where = lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)[:, None] + rows
    where = jnp.where(rows < recv_sizes[:, None], where, output.shape[0])  # past the end: not written
    return output.at[where.reshape(-1)].set(got.reshape(-1, *got.shape[2:]).astype(output.dtype), mode="drop")


def _local_groups(plan: ExchangePlan, rows: int) -> jax.Array:
    """[rows] each received row's local expert (E/n past the filled rows): the buffer is the runs (i, l) in that
    order, without gaps, so a row's run is the count of runs that start at or before it, less one."""
    sizes = plan.runs.reshape(-1)
    starts = jnp.zeros((rows,), jnp.int32).at[_exclusive(sizes)].add(1, mode="drop")
    run = jnp.cumsum(starts) - 1
    local = plan.runs.shape[1]
    return jnp.where(jnp.arange(rows) < jnp.sum(sizes), run % local, local)


def ragged_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array], axis: str,
                   capacity: int, swiglu_grouped: Callable) -> tuple[jax.Array, jax.Array]:
    """(y [N, D], assignments dropped) with this device's E/n experts `w` over the manual `axis`; `capacity`
    rows received at most; `swiglu_grouped(rows, w, group_sizes)` the experts' grouped MLP."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    tokens, k = experts.shape
    local = w["w_gate"].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, so by owner
    sent = x[order // k]
    counts = lax.all_gather(jnp.bincount(flat, length=n * local).astype(jnp.int32), axis)  # [n, E]
    plan = exchange_plan(counts, me, capacity)

    bound = min(tokens * k, capacity)  # rows any one device sends any other
    received = ragged_all_to_all(sent, jnp.zeros((capacity, x.shape[-1]), x.dtype), plan.send_offsets,
                                 plan.send_sizes, plan.remote_offsets, plan.recv_sizes, axis, bound)
    groups = _local_groups(plan, capacity)
    by_expert = jnp.argsort(groups, stable=True)
    out = swiglu_grouped(received[by_expert], w, plan.group_sizes)
    out = jnp.zeros_like(out).at[by_expert].set(out)  # back to sender-major
    # The way back: each sender's rows return to where they left its sorted buffer.
    returned_to = _exclusive(counts.reshape(n, n, local).sum(-1), axis=1)[:, me]
    back = ragged_all_to_all(out, jnp.zeros((tokens * k, out.shape[-1]), out.dtype), plan.recv_offsets,
                             plan.recv_sizes, returned_to, plan.send_sizes, axis, bound)

    kept = jnp.zeros((tokens * k,), bool).at[order].set(_kept_in_sorted_order(plan, flat[order] // local))
    ys = jnp.zeros_like(back).at[order].set(back).reshape(tokens, k, -1)
    y = jnp.einsum("nkd,nk->nd", ys, (weights * kept.reshape(tokens, k)).astype(ys.dtype))
    return y, jnp.sum(~kept).astype(jnp.float32)


def _kept_in_sorted_order(plan: ExchangePlan, owner: jax.Array) -> jax.Array:
    """Whether each of my sorted assignments (its expert's owner device `owner`) fits its receiver's cap."""
    place = jnp.arange(owner.shape[0]) - plan.send_offsets[owner]
    return place < plan.send_sizes[owner]
