"""Causal grouped-query attention: the `AttentionFn` every call goes through, and `select_attention`, which picks the
implementation (they import nothing of this module; context parallelism passes its own: pjax/parallel/context/)."""
from __future__ import annotations

import os
import re
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mesh.backend import target_backend
from mesh.errors import ConfigError
from mesh.mesh import DATA, TP, current
from mesh.rules import vary
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
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)  # noqa: E731
    return manual_everywhere(attend)(q, k, v) if impl == "cudnn" else attend(q, k, v)


def manual_everywhere(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`attend(q, k, v)` in a region manual over every mesh axis, where some already are (a data-parallel or
    pipeline shard_map): cuDNN's partitioner fails on a region manual over some axes only (ARCHITECTURE.md,
    "cuDNN attention in every layout"). Rows split over dp and heads over tp where those axes are automatic.
    A custom_vjp carries the kernel's residuals out of the region, one block per device: differentiating the
    nested shard_map itself gives them the outer manual axes' shapes too (jax 0.10.2)."""
    mesh = current()
    if mesh.empty or not mesh.manual_axes:
        return attend
    auto = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    # Every automatic axis is named, so q, k, v and all the kernel's residuals vary over each of them; the
    # axes other than dp (dp x ep) and tp are of size 1 wherever a region is manual (pp and cp make their own).
    if any(mesh.shape[a] > 1 for a in auto if a not in (*DATA, TP)):
        return attend
    rows = tuple(a for a in DATA if a in auto) or None
    spec = P(rows, None, tuple(a for a in auto if a not in DATA) or None, None)
    per_device = P(auto)  # a device's own residual, stacked along a new leading axis
    pullback_tree = []

    def forward(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        leaves, tree = jax.tree.flatten(pullback)
        pullback_tree.append(tree)
        return out, [leaf[None] for leaf in vary(leaves, auto)]

    def backward(residuals, d_out):
        pullback = jax.tree.unflatten(pullback_tree[-1], [r[0] for r in residuals])
        return pullback(d_out)

    manual_forward = jax.shard_map(forward, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, per_device),
                                   axis_names=set(auto))
    manual_backward = jax.shard_map(backward, mesh=mesh, in_specs=(per_device, spec), out_specs=(spec,) * 3,
                                    axis_names=set(auto))

    @jax.custom_vjp
    def attention(q, k, v):
        return manual_forward(q, k, v)[0]

    attention.defvjp(lambda q, k, v: manual_forward(q, k, v), manual_backward)
    return attention

