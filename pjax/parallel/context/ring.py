"""Ring attention over `cp` (`context.strategy=ring`): K/V blocks passed around with `ppermute`, each folded
into the zigzag queries' online softmax; the backward is a second ring (ARCHITECTURE.md, "Zigzag ring attention")."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP, current
from models.attention import AttentionFn
from pjax.parallel.context.online_softmax import (F32, causal, finish, fold, fold_grad, recomputing_vjp,
                                                  softmax_delta, split, start)
from pjax.parallel.context.zigzag import zigzag_pairs

LAYOUTS = ("zigzag", "contiguous")  # contiguous: masked instead of skipped, for comparison only


def _pairs(layout: str, i: jax.Array, j: Any, first: bool, q_pos: jax.Array, kv_pos: jax.Array):
    """(query chunk, key chunk, visible) to compute this ring step; visible=None means all of it.
    Masks come only from the own block (step 0), so local positions suffice."""
    if layout == "zigzag":
        return [(qh, kh, causal(q_pos, kv_pos, qh, kh) if masked else None)
                for qh, kh, masked in zigzag_pairs(i, j, first)]
    return [(0, 0, causal(q_pos, kv_pos, 0, 0) if first else j < i)]


def _shift(x: Any, cp: int) -> Any:
    """Send to the next device on the ring (device i receives device i-1's block)."""
    return lax.ppermute(x, CP, perm=[(d, (d + 1) % cp) for d in range(cp)])


def _ring_loop(step: Callable, carry: Any, kv: Any, cp: int) -> Any:
    """carry = step(carry, kv_j, s, first) for s = 0..cp-1, j = i - s; the next block is sent while this one is used."""
    if cp == 1:
        return step(carry, kv, 0, True)
    nxt = _shift(kv, cp)
    carry = step(carry, kv, 0, True)

    def body(s, state):
        carry, kv = state
        nxt = _shift(kv, cp)
        return step(carry, kv, s, False), nxt

    carry, kv = lax.fori_loop(1, cp - 1, body, (carry, nxt))
    return step(carry, kv, cp - 1, False)


def _forward(q, k, v, q_pos, kv_pos, cp: int, layout: str):
    """Per-device ring forward: (out [B, T_l, H, D], lse [B, n, c, KV, G] fp32)."""
    n, kvh = (2 if layout == "zigzag" else 1), k.shape[2]
    qs, ks, vs = split(q, n, kvh), split(k, n), split(v, n)
    qp, kp = q_pos.reshape(q_pos.shape[0], n, -1), kv_pos.reshape(kv_pos.shape[0], n, -1)
    i = lax.axis_index(CP)

    def step(acc, kv, s, first):
        # The own block comes first, so every row has a finite running max before a fully masked one.
        for qh, kh, visible in _pairs(layout, i, (i - s) % cp, first, qp, kp):
            acc = fold(acc, qs, *kv, qh, kh, visible)
        return acc

    return finish(_ring_loop(step, start(qs), (ks, vs), cp), q)


def _backward(q, k, v, q_pos, kv_pos, out, lse, g, cp: int, layout: str):
    """Per-device ring backward: the K/V ring again, with dK/dV travelling beside their block."""
    n, kvh = (2 if layout == "zigzag" else 1), k.shape[2]
    qs, ks, vs, dos = split(q, n, kvh), split(k, n), split(v, n), split(g.astype(q.dtype), n, kvh)
    qp, kp = q_pos.reshape(q_pos.shape[0], n, -1), kv_pos.reshape(kv_pos.shape[0], n, -1)
    delta = softmax_delta(g, out, n, kvh)
    i = lax.axis_index(CP)

    def step(carry, kv, s, first):
        dq, dkv = carry
        if not first:
            dkv = _shift(dkv, cp)  # block j's dK/dV follow it
        grads = (dq, *dkv)
        for qh, kh, visible in _pairs(layout, i, (i - s) % cp, first, qp, kp):
            grads = fold_grad(grads, qs, *kv, dos, lse, delta, qh, kh, visible)
        return grads[0], grads[1:]

    zeros_kv = jnp.zeros_like(ks, dtype=F32)
    dq, dkv = _ring_loop(step, (jnp.zeros_like(qs, dtype=F32), (zeros_kv, zeros_kv)), (ks, vs), cp)
    if cp > 1:
        dkv = _shift(dkv, cp)  # device i holds block i+1's gradients: send them home
    dk, dv = (d.astype(k.dtype).reshape(k.shape) for d in dkv)
    return dq.astype(q.dtype).reshape(q.shape), dk, dv


def ring_attention(layout: str = "zigzag", custom_backward: bool = True) -> AttentionFn:
    """An `AttentionFn` for sequences split over the ambient mesh's `cp` in `layout`; `custom_backward=False`
    lets autodiff differentiate the forward ring (storing every block), to measure what the custom one saves."""
    if layout not in LAYOUTS:
        raise ConfigError(f"context-parallel layout {layout!r} is unknown; choose one of {', '.join(LAYOUTS)}.")

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        cp = current().shape[CP]
        chunks = 2 * cp if layout == "zigzag" else cp
        if q.shape[1] % chunks:
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by {chunks}, the number of "
                              f"{layout} chunks for mesh.cp={cp}; change train.seq_len.")
        forward, backward = (functools.partial(f, cp=cp, layout=layout) for f in (_forward, _backward))
        if custom_backward:
            return recomputing_vjp(forward, backward)(q, k, v, q_pos, kv_pos)
        seq = P(None, CP)
        return rules.per_device(lambda *a: forward(*a)[0], seq, seq)(q, k, v, q_pos, kv_pos)
    return attention

