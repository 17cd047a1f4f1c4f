"""Causal grouped-query attention: the `AttentionFn` every call goes through, and `select_attention`, which picks the
implementation (they import nothing of this module; context parallelism passes its own: pjax/parallel/context/)."""
from __future__ import annotations

import os
import re
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from mesh.backend import target_backend
from mesh.errors import ConfigError
from models.chunked_attention import chunked_causal_attention
from models.cpu_attention import blocked_causal_attention
from models.reference_attention import reference_attention


class AttentionFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        """q: [B, T, H, D]; k, v: [B, S, KV, D]; positions [B, T] / [B, S]; returns [B, T, H, D]."""


def select_attention(impl: str = "auto") -> Callable[..., jax.Array]:
    """'reference', 'blocked' (fast on XLA:CPU), 'chunked' (no scores kept for the backward) or
    'cudnn' (GPU); 'auto': cuDNN on GPU, blocked elsewhere."""
    if impl == "auto":
        impl = "cudnn" if target_backend() == "gpu" else "blocked"
    if impl == "reference":
        return reference_attention
    if impl == "blocked":
        return blocked_causal_attention
    if impl == "chunked":
        return chunked_causal_attention
    if impl == "cudnn":
        if target_backend() != "gpu":
            raise ConfigError(f"train.attention=cudnn needs a GPU, and this run's backend is {target_backend()}; "
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
    # Assumes contiguous positions; named, not None (ARCHITECTURE.md, "cuDNN attention asked for by name").
    del q_pos, kv_pos
    impl = "cudnn" if cudnn_supported(q) else "xla"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
