"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses; `context.strategy=ulysses`).

Outside attention every device holds a slice of the sequence (T/cp tokens, all heads). Around
attention an all-to-all over cp trades that for the whole sequence and 1/cp of the heads: each
device sends head group g of its tokens to device g, and receives every device's tokens for its
own group. Attention is then ordinary local causal attention over the full sequence (the
backend's own: blocked on CPU, cuDNN on GPU, with its own backward), and a second all-to-all
trades back. The exchanges only move elements, so each one's transpose is the other: the
backward is the same two exchanges in reverse order, around the local attention's backward.

The sequence arrives in the zigzag layout the data pipeline uses for every strategy; after the
all-to-all the tokens are in device order (0, 2cp-1, 1, 2cp-2, ...) and a local reshuffle puts
them in order, so the local kernel's causal mask is the plain one.

Heads are split over tp too, and the exchange must not cross tp devices: each tp device splits
its own heads over cp, so `num_attention_heads / tp` must be divisible by cp. The heads are
viewed as [kv_heads/cp, cp, group] with tp on the first dimension and the all-to-all on the
second, so a device receives whole GQA groups (queries with their kv-head). Where a tp device
has fewer kv-heads than cp, each is repeated until it has cp of them.

Communication per call: the all-to-all of q, k, v and the output forward, and of their
gradients backward, each moving (cp-1)/cp of the tensor a device holds. Unlike the ring's,
these bytes do not grow with cp at a fixed sequence per device, and there is no loop. The
positions are all-gathered too, for local attention that reads them (the reference); the
blocked and cuDNN kernels assume tokens in order, and XLA drops the unused gather.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP, TP
from models.attention import AttentionFn
from pjax.parallel.context.zigzag import zigzag_chunks


def validate_heads(num_heads: int, kv_heads: int, cp: int, tp: int) -> None:
    """A one-line ConfigError unless both kinds of heads split over cp on each tp device."""
    if (num_heads // tp) % cp:
        raise ConfigError(f"context.strategy=ulysses splits each tp device's heads over cp, and "
                          f"model.num_attention_heads/mesh.tp = {num_heads // tp} is not divisible by mesh.cp={cp}; "
                          f"use context.strategy=ring or all_gather, or another mesh.cp.")
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
    """Per device: [B, T/cp, A, cp, g, D] -> [1, B, T, A*g, D], head group i of every device's
    tokens on device i, the tokens in order."""
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
    return _reorder(lax.all_gather(q_pos, CP, axis=1, tiled=True), np.argsort(_device_order(cp)))[None]


def ulysses_attention(mesh: Mesh, local: AttentionFn) -> AttentionFn:
    """An `AttentionFn` for sequences split over `cp` (zigzag), attending with `local` per head group."""
    cp, tp = mesh.shape[CP], mesh.shape[TP]
    # Outside: [B, T, ...] with the sequence split over cp. Between the exchanges: a leading axis
    # of one head group per cp device, so attention runs outside any shard_map, heads automatic
    # over tp. The exchanges run manual over tp as well (XLA's partitioner would otherwise gather
    # the heads over tp before each all-to-all) and carry their own transposes: shard_map's
    # transpose rule, nested in another shard_map, emits shardings Shardy's verifier refuses
    # (the same reason the ring has a custom_vjp outside its shard_maps). They hold nothing but
    # data movement, so no constant inside them is hoisted out of the layer scan either.
    seq, heads, group, group_heads = P(None, CP), P(None, CP, TP), P(CP), P(CP, None, None, TP)

    def exchanges(g: int) -> tuple[Callable, Callable]:
        there = rules.per_device(functools.partial(_to_heads, cp=cp), mesh, heads, group_heads)
        back = rules.per_device(functools.partial(_to_sequence, cp=cp, g=g), mesh, group_heads, heads)
        return _with_transpose(there, back), _with_transpose(back, there)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        if q.shape[1] % (2 * cp):
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by 2*mesh.cp = {2 * cp}, the "
                              f"number of zigzag chunks; change train.seq_len.")
        del kv_pos  # the model attends within one sequence: the keys are the queries' tokens
        b, t, h, d = q.shape
        kv = k.shape[2]
        if (kv // tp) % cp:  # fewer kv-heads per tp device than cp: repeat each so head group g finds its own
            k, v = (jnp.repeat(x, cp * tp // kv, axis=2) for x in (k, v))
            kv = k.shape[2]
        # Heads as [kv/cp, cp, group]: the all-to-all splits the cp-sized dimension and tp stays
        # on the first, so the exchange never crosses tp devices; a query head and its kv-head
        # share their (kv/cp, cp) indices, so every device gets whole GQA groups.
        a = kv // cp
        q_heads, q_back = exchanges(h // kv)
        kv_heads = exchanges(1)[0]
        groups = [q_heads(q.reshape(b, t, a, cp, -1, d))] + [kv_heads(x.reshape(b, t, a, cp, 1, d)) for x in (k, v)]
        pos = rules.per_device(functools.partial(_gather_positions, cp=cp), mesh, seq, group)(q_pos)
        rows = [x.reshape(-1, *x.shape[2:]) for x in (*groups, pos)]  # [cp * B, T, ...]: head groups as rows
        out = local(*rows[:3], rows[3], rows[3]).reshape(groups[0].shape)
        return q_back(out).reshape(b, t, h, d)
    return attention
