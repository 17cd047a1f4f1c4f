"""Context parallelism by all-gather: each device gathers every key and value over `cp` and
attends its own queries to them (`context.strategy=all_gather`).

The sequence is split over cp in the zigzag layout (`zigzag.zigzag_layout`): device i
holds chunks i ("early") and 2cp-1-i ("late") of 2cp. Instead of passing K/V blocks around a
ring, the forward all-gathers K and V once -- with their kv-heads only, so under grouped-query
attention this is the small half of the attention inputs -- and each device folds the chunk
pairs its queries need into an online softmax (`online_softmax`):

  * the early query chunk i sees key chunks 0..i-1 whole, and chunk i under a causal mask;
  * the late one, 2cp-1-i, sees chunks 0..2cp-2-i whole, and chunk 2cp-1-i under a mask.

That is 2cp-1 whole pairs on every device (i + 2cp-1-i), run by one fixed-length loop whose
step s is (early, chunk s) while s < i and (late, chunk s-i) after, plus the two masked
diagonal pairs: 2cp+1 pairs, the ring's count, with nothing above the diagonal computed.

The backward (a `custom_vjp`, saving only local q, k, v, the output and the log-sum-exp)
gathers K and V again, recomputes each pair, accumulates dK and dV for the whole sequence in
fp32, and reduce-scatters them back to their owners: the gathered order puts device d's two
chunks at positions 2d and 2d+1, so a tiled `psum_scatter` over cp is exactly "send each chunk's
gradient home".

Communication per call, with one K/V block = B*T/cp*kv_heads*head_dim elements: forward an
all-gather of K and V (2(cp-1) blocks received), backward the same plus a reduce-scatter of dK
and dV (2(cp-1) fp32 blocks): the ring's bytes less two fp32 blocks, in six collectives per
layer (four all-gathers, two reduce-scatters) whatever cp is, where the ring's permutes grow with
cp, and with no step waiting on a neighbour. The price is memory: the gathered K/V (and, in the
backward, their fp32 gradients) are the whole sequence's, O(T) per device where the ring holds
two blocks.

The collectives themselves run in shard_maps nested manual over tp as well (`_over_tp`): XLA
would otherwise gather the kv-heads over tp before each one.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP, TP
from models.attention import AttentionFn
from pjax.parallel.context.online_softmax import (F32, causal, finish, fold, fold_grad, recomputing_vjp,
                                                  softmax_delta, split, start)


def _gathered_index(chunk: jax.Array, cp: int) -> jax.Array:
    """Where chunk `chunk` (of 2cp) sits in the gathered order: device d's chunks d, 2cp-1-d at 2d, 2d+1."""
    return jnp.where(chunk < cp, 2 * chunk, 4 * cp - 1 - 2 * chunk)


def _whole_pair(s: jax.Array, i: jax.Array, cp: int) -> tuple[jax.Array, jax.Array]:
    """(query half, gathered key index) of step s of the unmasked loop on device i."""
    late = s >= i
    return late * 1, _gathered_index(jnp.where(late, s - i, s), cp)


def _diagonal(i: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> list[tuple[int, jax.Array, jax.Array]]:
    """The two masked pairs (query half, gathered key index, mask): each half against its own chunk."""
    qp, kp = (p.reshape(p.shape[0], 2, -1) for p in (q_pos, kv_pos))
    return [(h, 2 * i + h, causal(qp, kp, h, h)) for h in (0, 1)]


def _over_tp(collective: Callable, mesh: Mesh) -> Callable:
    """`collective` ([B, n, c, KV, D] -> ...) manual over tp too, the kv-heads split.

    Left automatic, tp would be gathered first: XLA's partitioner replicates the operand of an
    all-gather or reduce-scatter over the axes a shard_map leaves to it (a permute it keeps
    split). The nested shard_map holds the collective alone, so autodiff and the layer scan's
    loop-invariant hoisting never look inside it.
    """
    heads = P(None, None, None, TP)
    return lambda x: rules.per_device(collective, mesh, heads, heads)(x)


def _gather(x: jax.Array, mesh: Mesh) -> jax.Array:
    return _over_tp(lambda y: lax.all_gather(y, CP, axis=1, tiled=True), mesh)(x)


def _scatter(x: jax.Array, mesh: Mesh) -> jax.Array:
    return _over_tp(lambda y: lax.psum_scatter(y, CP, scatter_dimension=1, tiled=True), mesh)(x)


def _forward(q, k, v, q_pos, kv_pos, cp: int, mesh: Mesh):
    """Per-device forward: (out [B, T_l, H, D], lse [B, 2, c, KV, G] fp32)."""
    i = lax.axis_index(CP)
    qs, kg, vg = split(q, 2, k.shape[2]), _gather(split(k, 2), mesh), _gather(split(v, 2), mesh)

    def whole(s, acc):
        return fold(acc, qs, kg, vg, *_whole_pair(s, i, cp), None)

    acc = lax.fori_loop(0, 2 * cp - 1, whole, start(qs))
    for qh, kh, visible in _diagonal(i, q_pos, kv_pos):
        acc = fold(acc, qs, kg, vg, qh, kh, visible)
    return finish(acc, q)


def _backward(q, k, v, q_pos, kv_pos, out, lse, g, cp: int, mesh: Mesh):
    """Per-device backward: the pairs again; dK/dV of the whole sequence reduce-scattered home."""
    i, kvh = lax.axis_index(CP), k.shape[2]
    qs, dos = split(q, 2, kvh), split(g.astype(q.dtype), 2, kvh)
    kg, vg = _gather(split(k, 2), mesh), _gather(split(v, 2), mesh)
    delta = softmax_delta(g, out, 2, kvh)

    def whole(s, grads):
        return fold_grad(grads, qs, kg, vg, dos, lse, delta, *_whole_pair(s, i, cp), None)

    grads = (jnp.zeros_like(qs, dtype=F32), jnp.zeros_like(kg, dtype=F32), jnp.zeros_like(vg, dtype=F32))
    grads = lax.fori_loop(0, 2 * cp - 1, whole, grads)
    for qh, kh, visible in _diagonal(i, q_pos, kv_pos):
        grads = fold_grad(grads, qs, kg, vg, dos, lse, delta, qh, kh, visible)
    dq, dkg, dvg = grads
    dk, dv = (_scatter(d, mesh).astype(k.dtype).reshape(k.shape) for d in (dkg, dvg))
    return dq.astype(q.dtype).reshape(q.shape), dk, dv


def all_gather_attention(mesh: Mesh) -> AttentionFn:
    """An `AttentionFn` for sequences split over `cp` in the zigzag layout, by all-gathered K/V."""
    cp = mesh.shape[CP]
    attend = recomputing_vjp(functools.partial(_forward, cp=cp, mesh=mesh),
                             functools.partial(_backward, cp=cp, mesh=mesh), mesh)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        if q.shape[1] % (2 * cp):
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by 2*mesh.cp = {2 * cp}, the "
                              f"number of zigzag chunks; change train.seq_len.")
        return attend(q, k, v, q_pos, kv_pos)
    return attention
