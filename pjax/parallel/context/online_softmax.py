"""Attention over chunk pairs with an online softmax: the arithmetic the ring and all-gather share.

q is [B, n, c, KV, G, D] (GQA never repeats K/V), k and v [B, n, c, KV, D]. The forward folds one chunk pair
at a time into a running (out, max, sum); the backward recomputes each pair from the log-sum-exp."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import rules
from mesh.mesh import CP

MASKED = -1e30  # finite, so a fully masked block gives exp(-1e30 - m) = 0 rather than NaN
F32 = jnp.float32


def split(x: jax.Array, n: int, kv_heads: int | None = None) -> jax.Array:
    """[B, T, heads, D] -> [B, n, T/n, heads, D] (queries: [B, n, T/n, KV, G, D])."""
    b, t = x.shape[:2]
    heads = (kv_heads, x.shape[2] // kv_heads) if kv_heads else (x.shape[2],)
    return x.reshape((b, n, t // n) + heads + (x.shape[-1],))


def at(x: jax.Array, h: Any) -> jax.Array:
    """Chunk h of x (axis 1)."""
    return lax.dynamic_index_in_dim(x, h, axis=1, keepdims=False)


def add_at(x: jax.Array, h: Any, y: jax.Array) -> jax.Array:
    """x with y added to its chunk h."""
    return lax.dynamic_update_index_in_dim(x, at(x, h) + y, h, axis=1)


def causal(q_pos: jax.Array, kv_pos: jax.Array, qh: Any, kh: Any) -> jax.Array:
    """The causal mask of a chunk pair from the tokens' positions ([B, n, c] each): [B, c, 1, 1, c']."""
    return (at(q_pos, qh)[:, :, None] >= at(kv_pos, kh)[:, None, :])[:, :, None, None, :]


def _scores(q: jax.Array, k: jax.Array, visible: jax.Array | None) -> jax.Array:
    """fp32 scores [B, c, KV, G, c'] of one query chunk against one key chunk."""
    s = jnp.einsum("bqkgd,bskd->bqkgs", q, k, preferred_element_type=F32) * (q.shape[-1] ** -0.5)
    return s if visible is None else jnp.where(visible, s, MASKED)


def start(qs: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The empty running (out, max, sum) for queries qs; zeros_like keeps qs's varying type, as a loop carry must."""
    stats = jnp.zeros_like(qs[..., 0], dtype=F32)
    return jnp.zeros_like(qs, dtype=F32), stats - jnp.inf, stats


def fold(acc, q, k, v, qh, kh, visible):
    """Fold key chunk kh into the running (out, max, sum) of query chunk qh; visible=None: all of it."""
    o, m, l = (at(a, qh) for a in acc)
    s = _scores(at(q, qh), at(k, kh), visible)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bqkgs,bskd->bqkgd", p.astype(v.dtype), at(v, kh), preferred_element_type=F32)
    new = (o * corr[..., None] + pv, m_new, l * corr + p.sum(-1))
    return tuple(lax.dynamic_update_index_in_dim(a, x, qh, axis=1) for a, x in zip(acc, new))


def finish(acc, like: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out in `like`'s dtype and shape, log-sum-exp [B, n, c, KV, G] fp32) from the running sums."""
    o, m, l = acc
    return (o / l[..., None]).astype(like.dtype).reshape(like.shape), m + jnp.log(l)


def softmax_delta(g: jax.Array, out: jax.Array, n: int, kv_heads: int) -> jax.Array:
    """rowsum(dO * O) per query, chunked: the softmax backward's correction term."""
    return jnp.sum(split(g, n, kv_heads).astype(F32) * split(out, n, kv_heads).astype(F32), axis=-1)


def fold_grad(grads, q, k, v, do, lse, delta, qh, kh, visible):
    """Backward of one chunk pair, scores recomputed: add its dQ (chunk qh) and dK, dV (chunk kh)."""
    dq, dk, dv = grads
    qb, kb, vb, dob = at(q, qh), at(k, kh), at(v, kh), at(do, qh)
    p = jnp.exp(_scores(qb, kb, visible) - at(lse, qh)[..., None])
    dp = jnp.einsum("bqkgd,bskd->bqkgs", dob, vb, preferred_element_type=F32)
    ds = (p * (dp - at(delta, qh)[..., None]) * (q.shape[-1] ** -0.5)).astype(q.dtype)
    dq = add_at(dq, qh, jnp.einsum("bqkgs,bskd->bqkgd", ds, kb, preferred_element_type=F32))
    dk = add_at(dk, kh, jnp.einsum("bqkgs,bqkgd->bskd", ds, qb, preferred_element_type=F32))
    dv = add_at(dv, kh, jnp.einsum("bqkgs,bqkgd->bskd", p.astype(v.dtype), dob, preferred_element_type=F32))
    return dq, dk, dv


def recomputing_vjp(forward: Callable, backward: Callable) -> Callable:
    """attend(q, k, v, q_pos, kv_pos) -> out from per-device `forward` and `backward`; the custom_vjp sits
    outside the shard_maps, so autodiff never transposes a nested one (ARCHITECTURE.md says why)."""
    seq = P(None, CP)  # every argument and result is [B, T or chunks, ...] split over cp on axis 1

    def run(fn: Callable, out_specs: Any) -> Callable:
        return rules.per_device(fn, seq, out_specs)

    @jax.custom_vjp
    def attend(q, k, v, q_pos, kv_pos):
        return run(forward, (seq, seq))(q, k, v, q_pos, kv_pos)[0]

    def attend_fwd(q, k, v, q_pos, kv_pos):
        out, lse = run(forward, (seq, seq))(q, k, v, q_pos, kv_pos)
        return out, (q, k, v, q_pos, kv_pos, out, lse)

    def attend_bwd(res, g):
        return (*run(backward, (seq, seq, seq))(*res, g), None, None)  # integer positions: no cotangent

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
