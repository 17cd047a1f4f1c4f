"""Context parallelism by all-gather (`context.strategy=all_gather`): K/V gathered over `cp` (kv-heads only),
each device's zigzag pairs folded into an online softmax, dK/dV reduce-scattered home
(ARCHITECTURE.md, "Three context-parallel strategies on one layout")."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP, TP, current
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


def _over_tp(collective: Callable) -> Callable:
    """`collective` ([B, n, c, KV, D] -> ...) in a shard_map manual over tp too, holding nothing else."""
    heads = P(None, None, None, TP)
    return lambda x: rules.per_device(collective, heads, heads)(x)


def _gather(x: jax.Array) -> jax.Array:
    return _over_tp(lambda y: lax.all_gather(y, CP, axis=1, tiled=True))(x)


def _scatter(x: jax.Array) -> jax.Array:
    return _over_tp(lambda y: lax.psum_scatter(y, CP, scatter_dimension=1, tiled=True))(x)


def _forward(q, k, v, q_pos, kv_pos, cp: int):
    """Per-device forward: (out [B, T_l, H, D], lse [B, 2, c, KV, G] fp32)."""
    i = lax.axis_index(CP)
    qs, kg, vg = split(q, 2, k.shape[2]), _gather(split(k, 2)), _gather(split(v, 2))

    def whole(s, acc):
        return fold(acc, qs, kg, vg, *_whole_pair(s, i, cp), None)

    acc = lax.fori_loop(0, 2 * cp - 1, whole, start(qs))
    for qh, kh, visible in _diagonal(i, q_pos, kv_pos):
        acc = fold(acc, qs, kg, vg, qh, kh, visible)
    return finish(acc, q)


def _backward(q, k, v, q_pos, kv_pos, out, lse, g, cp: int):
    """Per-device backward: the pairs again; dK/dV of the whole sequence reduce-scattered home."""
    i, kvh = lax.axis_index(CP), k.shape[2]
    qs, dos = split(q, 2, kvh), split(g.astype(q.dtype), 2, kvh)
    kg, vg = _gather(split(k, 2)), _gather(split(v, 2))
    delta = softmax_delta(g, out, 2, kvh)

    def whole(s, grads):
        return fold_grad(grads, qs, kg, vg, dos, lse, delta, *_whole_pair(s, i, cp), None)

    grads = (jnp.zeros_like(qs, dtype=F32), jnp.zeros_like(kg, dtype=F32), jnp.zeros_like(vg, dtype=F32))
    grads = lax.fori_loop(0, 2 * cp - 1, whole, grads)
    for qh, kh, visible in _diagonal(i, q_pos, kv_pos):
        grads = fold_grad(grads, qs, kg, vg, dos, lse, delta, qh, kh, visible)
    dq, dkg, dvg = grads
    dk, dv = (_scatter(d).astype(k.dtype).reshape(k.shape) for d in (dkg, dvg))
    return dq.astype(q.dtype).reshape(q.shape), dk, dv


def all_gather_attention() -> AttentionFn:
    """An `AttentionFn` for sequences split over the ambient mesh's `cp` (zigzag), by all-gathered K/V."""
    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        cp = current().shape[CP]
        if q.shape[1] % (2 * cp):
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by 2*mesh.cp = {2 * cp}, the "
                              f"number of zigzag chunks; change train.seq_len.")
        attend = recomputing_vjp(functools.partial(_forward, cp=cp), functools.partial(_backward, cp=cp))
        return attend(q, k, v, q_pos, kv_pos)
    return attention
