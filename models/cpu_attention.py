"""Causal attention in query blocks with a hand-written backward, the formulation XLA:CPU runs fast: where the [T, T]
form computes the masked upper triangle, query block i attends only to keys [0, (i+1)*b), only the diagonal tile masked,
and a `custom_vjp` writes the backward as plain matmuls. Assumes positions 0..T-1 in order."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.reference_attention import reference_attention

_NEG = -1e30  # finite: no inf - inf NaNs in any dtype


def _diag_bias(block: int) -> jax.Array:
    i = jnp.arange(block)
    return jnp.where(i[:, None] >= i[None, :], 0.0, _NEG).astype(jnp.float32)


def _add_at(x: jax.Array, y: jax.Array, start: int) -> jax.Array:
    """x with y added to its last axis' columns [start, start + width): `x.at[..., a:b].add`, but as slices. A
    slice spanning the axis makes that a scatter with zero-size indices, and differentiated twice (MAML) inside a
    shard_map, the backward's manual computation then takes only those zero-size constants, which Shardy refuses
    (jax 0.10.2)."""
    end = start + y.shape[-1]
    return lax.dynamic_update_slice_in_dim(x, x[..., start:end] + y, start, axis=x.ndim - 1)


def _forward(q, k, v, block):
    """q: [B, KV, T*G, D] (rows in (t, g) order); k, v: [B, KV, T, D] -> out like q, per-block probabilities."""
    g, d = q.shape[2] // k.shape[2], q.shape[-1]
    scale = d ** -0.5
    k_t = jnp.swapaxes(k, -1, -2)  # [B, KV, D, T]: scores are then a plain (non-transposed) matmul
    bias = jnp.repeat(_diag_bias(block), g, axis=0)  # each query row repeated for its g heads
    outs, probs = [], []
    for start in range(0, k.shape[2], block):
        end = start + block
        rows = q[:, :, start * g:end * g]
        s = jnp.einsum("bkrd,bkds->bkrs", rows, k_t[..., :end], preferred_element_type=jnp.float32) * scale
        p = jax.nn.softmax(_add_at(s, bias, start), axis=-1)
        probs.append(p)
        outs.append(jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), v[:, :, :end]))
    return jnp.concatenate(outs, axis=2), probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(q, k, v, block):
    return _forward(q, k, v, block)[0]


def _blocked_fwd(q, k, v, block):
    out, probs = _forward(q, k, v, block)
    return out, (q, k, v, out, probs)


def _blocked_bwd(block, res, d_out):
    q, k, v, out, probs = res
    b, kv, t, d = k.shape
    g, scale = q.shape[2] // t, d ** -0.5
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v, d_out = f32(q), f32(k), f32(v), f32(d_out)
    v_t = jnp.swapaxes(v, -1, -2)
    # rowsum(dO * O) per query row: the softmax Jacobian's correction term, [B, KV, T*G].
    delta = jnp.sum(d_out * f32(out), axis=-1)
    # dK and dV are accumulated transposed ([.., D, T]): Q^T dS is a plain matmul where dS^T Q
    # would contract over the rows of both operands (a transposed-LHS dot, slow on XLA:CPU).
    dk_t = jnp.zeros((b, kv, d, t), jnp.float32)
    dv_t = jnp.zeros((b, kv, d, t), jnp.float32)
    dq_blocks = []
    for i, start in enumerate(range(0, t, block)):
        end, rows = start + block, slice(start * g, (start + block) * g)
        p, do = probs[i], d_out[:, :, rows]
        dv_t = _add_at(dv_t, jnp.einsum("bkrd,bkrs->bkds", do, p), 0)
        dp = jnp.einsum("bkrd,bkds->bkrs", do, v_t[..., :end])
        ds = p * (dp - delta[:, :, rows, None]) * scale
        dq_blocks.append(jnp.einsum("bkrs,bksd->bkrd", ds, k[:, :, :end]))
        dk_t = _add_at(dk_t, jnp.einsum("bkrd,bkrs->bkds", q[:, :, rows], ds), 0)
    dq = jnp.concatenate(dq_blocks, axis=2)
    return dq.astype(res[0].dtype), jnp.swapaxes(dk_t, -1, -2).astype(res[1].dtype), \
        jnp.swapaxes(dv_t, -1, -2).astype(res[2].dtype)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
                             block: int = 64) -> jax.Array:
    """Causal GQA attention for the standard layout (positions not read). q: [B, T, H, D]; k, v: [B, T, KV, D]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    block = max(n for n in range(1, min(block, t) + 1) if t % n == 0)
    if block < min(16, t):
        return reference_attention(q, k, v, q_pos, kv_pos)
    # Head-major once per call: each block of queries is then one contiguous slice.
    rows = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * (h // kv), d)
    head_major = lambda x: x.transpose(0, 2, 1, 3)
    out = _blocked(rows, head_major(k), head_major(v), block)
    return out.reshape(b, kv, t, h // kv, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
