"""Causal grouped-query attention: the `AttentionFn` every call goes through, and `select_attention`, which picks the
implementation (they import nothing of this module; context parallelism passes its own: pjax/parallel/context/)."""
from __future__ import annotations

import os
import re
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mesh.backend import target_backend
from mesh.errors import ConfigError
from mesh.mesh import DATA, TP, current
from mesh.rules import vary
from models.chunked_attention import chunked_causal_attention
from models.cpu_attention import blocked_causal_attention
from models.reference_attention import reference_attention
from models.remat import ATTENTION


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
            raise ConfigError("cuDNN's fused attention fails in XLA (jax 0.11.2) under XLA_FLAGS' "
                              "--xla_gpu_deterministic_ops: drop the flag, or set train.attention=reference (6-7x "
                              "slower on SmolLM-135M).")
        return _cudnn_attention
    raise ValueError(f"unknown attention implementation {impl!r}; choose auto, reference, blocked, chunked or cudnn.")


def deterministic_gpu_ops() -> bool:
    """Whether XLA_FLAGS turns on XLA's deterministic GPU ops (`--xla_gpu_deterministic_ops[=true]`)."""
    flags = re.findall(r"--xla_gpu_deterministic_ops(?:=(\S*))?(?!\w)", os.environ.get("XLA_FLAGS", ""))
    return bool(flags) and flags[-1].lower() in ("", "true", "1")


def cudnn_supported(q: jax.Array) -> bool:
    """Whether cuDNN's fused attention takes these queries: 16-bit floats, head dim a multiple of 8 up to
    `head_dim_limit()`."""
    d = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= head_dim_limit()


def head_dim_limit() -> int:
    """cuDNN's largest head dim as JAX's check reads it (jax 0.10): 256 where JAX's own backend is a GPU of compute
    capability 9.0 or later, else 128 (a CPU host compiling for compile-only GPUs included)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return 128
    major = int(str(getattr(gpus[0], "compute_capability", "0")).split(".")[0] or 0)
    return 256 if major >= 9 else 128


def _cudnn_attention(q, k, v, q_pos, kv_pos):
    # Assumes contiguous positions (pjax's batches have no others); named, not None (ARCHITECTURE.md, "cuDNN
    # attention asked for by name"). A head dim cuDNN does not take runs chunked, never XLA's [B, H, T, T] form.
    if not cudnn_supported(q):
        return chunked_causal_attention(q, k, v, q_pos, kv_pos)
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
    return keeping_residuals(attend)(q, k, v)


def keeping_residuals(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`attend(q, k, v)` as a `custom_vjp` whose output and other residuals (cuDNN's log-sum-exp) are tagged
    `remat.ATTENTION`, which every remat policy but `full` keeps: untagged, a policy ran cuDNN's forward again in
    the backward, for the residuals and for the o projection's input. Where a data-parallel or pipeline region is
    manual over some mesh axes, the call runs in a nested shard_map manual over the rest: cuDNN's partitioner
    fails on a region manual over some axes only (ARCHITECTURE.md, "cuDNN attention in every layout"); its own
    residuals leave it one block per device (differentiating the nested shard_map itself gives them the outer
    manual axes' shapes too, jax 0.10.2)."""
    mesh = current()
    auto = () if mesh.empty or not mesh.manual_axes else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    # Every automatic axis is named, so q, k, v and all the kernel's residuals vary over each of them; the
    # axes other than dp (dp x ep) and tp are of size 1 wherever a region is manual (pp and cp make their own).
    manual = bool(auto) and not any(mesh.shape[a] > 1 for a in auto if a not in (*DATA, TP))
    found = []  # the pullback's structure, and which of its leaves are q, k, v or the output

    def local_forward(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        leaves, tree = jax.tree.flatten(pullback)
        known = [next((i for i, x in enumerate((q, k, v, out)) if leaf is x), None) for leaf in leaves]
        found.append((tree, known))
        return out, [leaf for leaf, i in zip(leaves, known) if i is None]

    def local_backward(q, k, v, out, own, d_out):
        tree, known = found[-1]
        rest = iter(own)
        leaves = [(q, k, v, out)[i] if i is not None else next(rest) for i in known]
        return jax.tree.unflatten(tree, leaves)(d_out)

    if manual:
        rows = tuple(a for a in DATA if a in auto) or None
        spec = P(rows, None, tuple(a for a in auto if a not in DATA) or None, None)
        per_device = P(auto)  # a device's own residual, stacked along a new leading axis

        def stacked_forward(q, k, v):
            out, own = local_forward(q, k, v)
            return out, [leaf[None] for leaf in vary(own, auto)]

        def stacked_backward(q, k, v, out, own, d_out):
            return local_backward(q, k, v, out, [leaf[0] for leaf in own], d_out)

        forward = jax.shard_map(stacked_forward, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, per_device),
                                axis_names=set(auto))
        backward = jax.shard_map(stacked_backward, mesh=mesh, in_specs=(spec,) * 4 + (per_device, spec),
                                 out_specs=(spec,) * 3, axis_names=set(auto))
    else:
        forward, backward = local_forward, local_backward

    @jax.custom_vjp
    def attention(q, k, v):
        return forward(q, k, v)[0]

    def attention_fwd(q, k, v):
        out, own = forward(q, k, v)
        out, own = checkpoint_name((out, own), ATTENTION)  # the output once: the primal and the residual
        return out, (q, k, v, out, own)

    attention.defvjp(attention_fwd, lambda res, d_out: backward(*res, d_out))
    return attention
