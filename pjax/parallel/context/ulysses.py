"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses; `context.strategy=ulysses`): T/cp tokens of
all heads traded for all T tokens, in sequence order (so the causal mask is the plain one), of 1/cp of the heads
for the backend's attention, then traded back (ARCHITECTURE.md, "Three context-parallel strategies on one layout")."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP, TP, current
from models.attention import AttentionFn
from pjax.parallel.context.zigzag import zigzag_chunks


def validate_heads(num_heads: int, kv_heads: int, cp: int, tp: int) -> None:
    """A one-line ConfigError unless both kinds of heads split over cp on each tp device."""
    if (num_heads // tp) % cp:
        raise ConfigError(f"context.strategy=ulysses splits each tp device's heads over cp: "
                          f"model.num_attention_heads/mesh.tp = {num_heads // tp} is not divisible by mesh.cp={cp}; "
                          f"use ring or all_gather, or another mesh.cp.")
    kv = kv_heads // tp
    if kv % cp and cp % kv:
        raise ConfigError(f"context.strategy=ulysses needs model.num_key_value_heads/mesh.tp = {kv} to divide or be "
                          f"divisible by mesh.cp={cp}; use context.strategy=ring or all_gather, or another mesh.cp.")


def _device_order(cp: int) -> np.ndarray:
    """The 2cp chunks in the order the all-to-all concatenates them: device 0's two, device 1's, ..."""
    return np.array([c for d in range(cp) for c in zigzag_chunks(cp, d)])


def _reorder(x: jax.Array, order: np.ndarray) -> jax.Array:
    """Chunk j of the result is chunk order[j] of x (2cp chunks along axis 1)."""
    c = x.shape[1] // len(order)
    # Static slices, not a gather: a gather's index array would become an operand of the enclosing
    # shard_map, and nested in another one its sharding is one Shardy's verifier refuses.
    return jnp.concatenate([x[:, j * c:(j + 1) * c] for j in order], axis=1)


def _to_heads(x: jax.Array, cp: int) -> jax.Array:
    """Per device: [B, T/cp, A, cp, g, D] -> [1, B, T, A*g, D], head group i of every device's tokens on device i."""
    b, t, a, _, g, d = x.shape
    x = lax.all_to_all(x, CP, split_axis=3, concat_axis=1, tiled=True)
    return _reorder(x.reshape(b, t * cp, a * g, d), np.argsort(_device_order(cp)))[None]


def _to_sequence(y: jax.Array, cp: int, g: int) -> jax.Array:
    """Per device: the inverse of `_to_heads`, which is also its transpose (both only move elements)."""
    _, b, t, ag, d = y.shape
    y = _reorder(y[0], _device_order(cp)).reshape(b, t, ag // g, 1, g, d)
    return lax.all_to_all(y, CP, split_axis=1, concat_axis=3, tiled=True)


def _with_transpose(f: Callable, f_t: Callable) -> Callable:
    """The linear map f, differentiated by f_t, its transpose."""
    @jax.custom_vjp
    def g(x):
        return f(x)

    g.defvjp(lambda x: (f(x), None), lambda _, ct: (f_t(ct),))
    return g


def _gather_positions(q_pos: jax.Array, cp: int) -> jax.Array:
    """For a local attention that reads positions (the reference); XLA drops it where unused."""
    return _reorder(lax.all_gather(q_pos, CP, axis=1, tiled=True), np.argsort(_device_order(cp)))[None]


def ulysses_attention(local: AttentionFn) -> AttentionFn:
    """An `AttentionFn` for sequences split over the ambient mesh's `cp` (zigzag), `local` per head group."""
    # Between the exchanges a leading axis holds one head group per cp device: attention runs outside any shard_map.
    seq, heads, group, group_heads = P(None, CP), P(None, CP, TP), P(CP), P(CP, None, None, TP)

    def exchanges(g: int, cp: int) -> tuple[Callable, Callable]:
        there = rules.per_device(functools.partial(_to_heads, cp=cp), heads, group_heads)
        back = rules.per_device(functools.partial(_to_sequence, cp=cp, g=g), group_heads, heads)
        return _with_transpose(there, back), _with_transpose(back, there)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        cp, tp = current().shape[CP], current().shape[TP]
        if q.shape[1] % (2 * cp):
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by 2*mesh.cp = {2 * cp}, the "
                              f"number of zigzag chunks; change train.seq_len.")
        del kv_pos  # the model attends within one sequence: the keys are the queries' tokens
        b, t, h, d = q.shape
        kv = k.shape[2]
        if (kv // tp) % cp:  # fewer kv-heads per tp device than cp: repeat each
            k, v = (jnp.repeat(x, cp * tp // kv, axis=2) for x in (k, v))
            kv = k.shape[2]
        # Heads as [kv/cp, cp, group], tp on the first: the exchange never crosses tp devices, and a
        # query head shares its kv-head's (kv/cp, cp) indices, so devices get whole GQA groups.
        a = kv // cp
        q_heads, q_back = exchanges(h // kv, cp)
        kv_heads = exchanges(1, cp)[0]
        groups = [q_heads(q.reshape(b, t, a, cp, -1, d))] + [kv_heads(x.reshape(b, t, a, cp, 1, d)) for x in (k, v)]
        pos = rules.per_device(functools.partial(_gather_positions, cp=cp), seq, group)(q_pos)
        rows = [x.reshape(-1, *x.shape[2:]) for x in (*groups, pos)]  # [cp * B, T, ...]: head groups as rows
        out = local(*rows[:3], rows[3], rows[3]).reshape(groups[0].shape)
        return q_back(out).reshape(b, t, h, d)
    return attention
