"""Causal attention in query chunks that saves only the log-sum-exp (the backward recomputes exp(scores - lse)):
flash attention's memory in plain JAX, and the planner's stand-in for cuDNN's memory in CPU compiles. Every
chunk scores all keys, masked ones too: twice the causal FLOPs, but one fixed-shape scan body whatever T is."""
from __future__ import annotations


import jax
import jax.numpy as jnp

_NEG = -1e30  # finite: no inf - inf NaNs in any dtype


def _scores(qc, k, qp, kv_pos):
    """One chunk's masked fp32 scores [B, KV, G, C, S]; qc: [B, C, KV, G, D], qp: [B, C]."""
    s = jnp.einsum("bckgd,bskd->bkgcs", qc, k, preferred_element_type=jnp.float32) * (qc.shape[-1] ** -0.5)
    return jnp.where(qp[:, None, None, :, None] >= kv_pos[:, None, None, None, :], s, _NEG)


def _forward(q, k, v, q_pos, kv_pos):
    """q: [N, B, C, KV, G, D] chunks, q_pos: [N, B, C] -> (out like q, lse [N, B, KV, G, C])."""
    def chunk(_, xs):
        qc, qp = xs
        s = _scores(qc, k, qp, kv_pos)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        return None, (jnp.einsum("bkgcs,bskd->bckgd", p.astype(v.dtype), v), lse)

    _, (out, lse) = jax.lax.scan(chunk, None, (q, q_pos))
    return out, lse


@jax.custom_vjp
def _chunked(q, k, v, q_pos, kv_pos):
    return _forward(q, k, v, q_pos, kv_pos)[0]


def _chunked_fwd(q, k, v, q_pos, kv_pos):
    out, lse = _forward(q, k, v, q_pos, kv_pos)
    return out, (q, k, v, q_pos, kv_pos, out, lse)


def _chunked_bwd(res, d_out):
    q, k, v, q_pos, kv_pos, out, lse = res
    f32 = lambda x: x.astype(jnp.float32)
    scale = q.shape[-1] ** -0.5

    def chunk(carry, xs):
        dk, dv = carry
        qc, qp, oc, doc, lc = xs
        p = jnp.exp(_scores(qc, k, qp, kv_pos) - lc[..., None])
        dv = dv + jnp.einsum("bkgcs,bckgd->bskd", p, f32(doc))
        dp = jnp.einsum("bckgd,bskd->bkgcs", f32(doc), f32(v))
        delta = jnp.einsum("bckgd,bckgd->bkgc", f32(doc), f32(oc))  # rowsum(dO * O)
        ds = p * (dp - delta[..., None]) * scale
        dq = jnp.einsum("bkgcs,bskd->bckgd", ds, f32(k))
        dk = dk + jnp.einsum("bkgcs,bckgd->bskd", ds, f32(qc))
        return (dk, dv), dq.astype(q.dtype)

    # Inside a shard_map the carry must vary over the same manual axes as what the body adds to
    # it: a zero drawn from every input gives it their union (plain zeros would be invariant).
    anchor = sum(f32(x.ravel()[0]) for x in (q, k, v, d_out)) * 0.0
    zeros = jnp.zeros(k.shape, jnp.float32) + anchor
    (dk, dv), dq = jax.lax.scan(chunk, (zeros, zeros), (q, q_pos, out, d_out, lse))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
                             chunk: int = 512) -> jax.Array:
    """Causal GQA attention by position in query chunks of at most `chunk` rows; q [B, T, H, D], k, v [B, S, KV, D]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    c = max(n for n in range(1, min(chunk, t) + 1) if t % n == 0)
    chunks = lambda x: jnp.moveaxis(x.reshape(b, t // c, c, *x.shape[2:]), 1, 0)
    out = _chunked(chunks(q.reshape(b, t, kv, h // kv, d)), k, v, chunks(q_pos), kv_pos)
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, d)
