"""Causal grouped-query attention: the one function every attention call goes through.

Context parallelism (ring attention) and backend-tuned kernels replace `attention` by passing a
different `AttentionFn` to the model; nothing else in the model knows how attention is computed.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from mesh.errors import ConfigError


class AttentionFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        """q: [B, T, H, D]; k, v: [B, S, KV, D]; positions [B, T] / [B, S]; returns [B, T, H, D]."""


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


def select_attention(impl: str = "auto") -> Callable[..., jax.Array]:
    """The attention implementation: 'reference', 'blocked' (fast on XLA:CPU), 'chunked' (keeps
    no scores for the backward: long sequences without a fused kernel) or 'cudnn' (GPU).

    'auto' picks cuDNN's fused kernel on GPU and the blocked form elsewhere.
    """
    if impl == "auto":
        impl = "cudnn" if jax.default_backend() == "gpu" else "blocked"
    if impl == "reference":
        return reference_attention
    if impl == "blocked":
        from models.cpu_attention import blocked_causal_attention

        return blocked_causal_attention
    if impl == "chunked":
        from models.chunked_attention import chunked_causal_attention

        return chunked_causal_attention
    if impl == "cudnn":
        if jax.default_backend() != "gpu":
            raise ConfigError(f"train.attention=cudnn needs a GPU, and this run's backend is {jax.default_backend()}; "
                              f"use auto, blocked or reference.")
        if deterministic_gpu_ops():
            raise ConfigError("XLA_FLAGS asks for --xla_gpu_deterministic_ops, and with it XLA (jax 0.11.2) fails "
                              "on cuDNN's fused attention (an IndexError from inside XLA); set train.attention=reference "
                              "for a deterministic run (6-7x slower on SmolLM-135M), or drop the flag.")
        return _cudnn_attention
    raise ValueError(f"unknown attention implementation {impl!r}; choose auto, reference, blocked, chunked or cudnn.")


def deterministic_gpu_ops() -> bool:
    """Whether XLA_FLAGS turns on XLA's deterministic GPU ops (`--xla_gpu_deterministic_ops[=true]`)."""
    flags = re.findall(r"--xla_gpu_deterministic_ops(?:=(\S*))?(?!\w)", os.environ.get("XLA_FLAGS", ""))
    return bool(flags) and flags[-1].lower() in ("", "true", "1")


def cudnn_supported(q: jax.Array) -> bool:
    """Whether cuDNN's fused attention takes these queries: 16-bit floats, head dim a multiple of 8 up to 128."""
    d = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128


def _cudnn_attention(q, k, v, q_pos, kv_pos):
    # cuDNN's fused kernel handles GQA and the causal mask itself; it assumes contiguous positions.
    # The implementation is named: `implementation=None` means XLA's unfused form (scores and
    # probabilities materialised in memory), not "cuDNN where possible".
    del q_pos, kv_pos
    impl = "cudnn" if cudnn_supported(q) else "xla"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
