"""Plain causal grouped-query attention in fp32: the model's default, and what the other kernels are tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
    """Plain causal GQA attention with scores and softmax in fp32.

    Queries are viewed as [kv_heads, group] instead of repeating K/V `group` times: the same math,
    without materialising the expanded keys and values (and it shards cleanly when kv_heads are
    split over tp). The mask comes from token positions, not indices, so a caller may hand in
    the tokens in any order (the zigzag context-parallel layout does), as long as every query
    sees at least its own key.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    causal = q_pos[:, None, None, :, None] >= kv_pos[:, None, None, None, :]
    # A large finite negative (not -inf) keeps the softmax free of inf-inf NaNs in any dtype.
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)
