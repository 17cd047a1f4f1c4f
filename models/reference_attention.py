"""Plain causal grouped-query attention in fp32: the model's default, and what the other kernels are tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
    """Causal GQA with queries as [kv_heads, group] (K/V never repeated), masked by positions (tokens in any order)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    causal = q_pos[:, None, None, :, None] >= kv_pos[:, None, None, None, :]
    # Finite, not -inf: no inf-inf NaNs in any dtype.
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)
