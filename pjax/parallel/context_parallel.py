"""Context parallelism: load-balanced (zigzag) ring attention with `shard_map` + `ppermute`.

The sequence is split over the mesh axis `cp`. Each device keeps its queries; key/value blocks
travel around a ring (device i sends to i+1), and each device folds every block it receives into
its queries' running softmax (the online softmax of FlashAttention). No device ever holds more
than two K/V blocks, so attention memory per device is O(T/cp).

Zigzag layout. A contiguous split is unbalanced under a causal mask: the device with the last
tokens attends to everything, the first only to itself. Cutting the sequence into 2*cp chunks
and giving device i the chunks (i, 2cp-1-i) -- one early, one late -- balances it. Call a
device's two chunks "early" (0) and "late" (1). When the block of device j arrives at device i:
  * late queries vs early keys: always entirely below the diagonal (2cp-1-i >= cp > j);
  * early queries vs late keys: always entirely above it -- skipped;
  * one "diagonal" pair (h, h): (early, early) if j < i, (late, late) if j > i; both, with a
    causal mask inside, when j == i (the device's own block, ring step 0).
So every device computes 3 chunk pairs at step 0 and 2 at every later step: 2cp+1 in all, the
same on every device and exactly the pairs that are not entirely masked (cp(2cp+1) over all
devices). No pair entirely above the diagonal is computed; only the two diagonal pairs of step 0
carry a mask. `zigzag_schedule` lists the pairs. (The contiguous layout, kept for comparison,
computes every block and masks: equal work per device, but ~2x the necessary total.)

Memory in the backward pass. Autodiff through the ring would keep every received K/V block
for the backward (memory growing with cp). A `jax.custom_vjp` saves only the local q, k, v, the
output and the log-sum-exp, and runs a second ring in the backward: K/V travel again, block
scores are recomputed, dQ stays home, and dK/dV (fp32) travel with their blocks and arrive
back at their owner after the last step.

Communication per ring attention call, with one K/V block = B*T/cp*kv_heads*head_dim elements:
forward 2*(cp-1) block sends (K and V); backward 2*(cp-1) again plus 2*cp fp32 dK/dV sends.
K/V travel with their original kv-heads: grouped-query attention is computed by viewing the
queries as [kv_heads, group], never by repeating K/V. The `shard_map` is manual over cp only,
so dp (batch) and tp (heads) stay automatic inside it.

Strategies. The ring is one of three ways `context.strategy` offers to attend across the split,
all on the zigzag layout: 'ring' (here, the default), 'all_gather' (context_gather.py: K/V
gathered once, the same chunk pairs folded locally) and 'ulysses' (ulysses.py: all-to-all from
sequence-split to head-split and back around the backend's own attention). `context_attention`
returns the one a run asks for.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP
from models.attention import AttentionFn
from pjax.parallel.online_softmax import (F32, causal, finish, fold, fold_grad, recomputing_vjp, softmax_delta,
                                          split, start)

LAYOUTS = ("zigzag", "contiguous")  # contiguous: masked instead of skipped, for comparison only


# ---------------------------------------------------------------------------------------------
# The layout and the schedule (plain Python, used by the data pipeline and the tests)
# ---------------------------------------------------------------------------------------------

def zigzag_chunks(cp: int, device: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*cp) that `device` holds: one early, one late."""
    return device, 2 * cp - 1 - device


def zigzag_layout(cp: int) -> Callable[[np.ndarray], np.ndarray]:
    """A `sequence_layout` for the DataIterator: permute the last axis so that the contiguous cp
    split of the result gives device i the chunks `zigzag_chunks(cp, i)` (the identity when cp=1)."""
    def layout(x: np.ndarray) -> np.ndarray:
        t = x.shape[-1]
        if cp == 1:
            return x
        if t % (2 * cp):
            raise ConfigError(f"train.seq_len={t} is not divisible by 2*mesh.cp = {2 * cp}; the zigzag "
                              f"context-parallel layout cuts the sequence into 2*cp equal chunks.")
        chunks = np.arange(t).reshape(2 * cp, t // (2 * cp))
        order = np.concatenate([chunks[c] for i in range(cp) for c in zigzag_chunks(cp, i)])
        return x[..., order]
    return layout


def _zigzag_pairs(i: Any, j: Any, first: bool) -> list[tuple[Any, Any, bool]]:
    """(query half, key half, causal) pairs device i folds in when it holds device j's K/V.

    Works on Python ints (for `zigzag_schedule`) and on traced ints (inside the ring), so the
    listing the tests check is the schedule the ring runs.
    """
    if first:  # j == i: the own block, diagonal pairs with a causal mask inside
        return [(1, 0, False), (0, 0, True), (1, 1, True)]
    h = (j > i) * 1  # 0: (early, early) when the block comes from a lower rank, 1: (late, late)
    return [(1, 0, False), (h, h, False)]


def zigzag_schedule(cp: int) -> list[list[list[tuple[int, int]]]]:
    """schedule[device][step]: the (query chunk, key chunk) pairs computed, as global chunk ids."""
    return [[[(zigzag_chunks(cp, i)[qh], zigzag_chunks(cp, (i - s) % cp)[kh])
              for qh, kh, _ in _zigzag_pairs(i, (i - s) % cp, s == 0)]
             for s in range(cp)] for i in range(cp)]


def _pairs(layout: str, i: jax.Array, j: Any, first: bool, q_pos: jax.Array, kv_pos: jax.Array):
    """(query chunk, key chunk, visible) to compute this ring step; visible=None means all of it.

    Masks only ever come from the device's own block (step 0), so local positions suffice.
    """
    if layout == "zigzag":
        return [(qh, kh, causal(q_pos, kv_pos, qh, kh) if masked else None)
                for qh, kh, masked in _zigzag_pairs(i, j, first)]
    # Contiguous: one chunk per device; a block is entirely visible iff it comes from a lower rank.
    return [(0, 0, causal(q_pos, kv_pos, 0, 0) if first else j < i)]


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------

def _shift(x: Any, cp: int) -> Any:
    """Send to the next device on the ring (device i receives device i-1's block)."""
    return lax.ppermute(x, CP, perm=[(d, (d + 1) % cp) for d in range(cp)])


def _ring_loop(step: Callable, carry: Any, kv: Any, cp: int) -> Any:
    """carry = step(carry, kv_j, s, first) for s = 0..cp-1, kv_j the K/V of device j = i - s.

    The next block is sent while the current one is used (independent ops XLA can overlap), and
    the last step sends nothing: cp-1 sends in all. A `fori_loop` keeps one block in flight,
    whatever cp is.
    """
    if cp == 1:
        return step(carry, kv, 0, True)
    nxt = _shift(kv, cp)
    carry = step(carry, kv, 0, True)

    def body(s, state):
        carry, kv = state
        nxt = _shift(kv, cp)
        return step(carry, kv, s, False), nxt

    carry, kv = lax.fori_loop(1, cp - 1, body, (carry, nxt))
    return step(carry, kv, cp - 1, False)


def _forward(q, k, v, q_pos, kv_pos, cp: int, layout: str):
    """Per-device ring forward: (out [B, T_l, H, D], lse [B, n, c, KV, G] fp32)."""
    n, kvh = (2 if layout == "zigzag" else 1), k.shape[2]
    qs, ks, vs = split(q, n, kvh), split(k, n), split(v, n)
    qp, kp = q_pos.reshape(q_pos.shape[0], n, -1), kv_pos.reshape(kv_pos.shape[0], n, -1)
    i = lax.axis_index(CP)

    def step(acc, kv, s, first):
        # The first step is the own (diagonal) block, so every query row has seen a key, and has
        # a finite running max, before any fully masked block (contiguous layout) arrives.
        for qh, kh, visible in _pairs(layout, i, (i - s) % cp, first, qp, kp):
            acc = fold(acc, qs, *kv, qh, kh, visible)
        return acc

    return finish(_ring_loop(step, start(qs), (ks, vs), cp), q)


def _backward(q, k, v, q_pos, kv_pos, out, lse, g, cp: int, layout: str):
    """Per-device ring backward: the K/V ring again, with dK/dV travelling beside their block."""
    n, kvh = (2 if layout == "zigzag" else 1), k.shape[2]
    qs, ks, vs, dos = split(q, n, kvh), split(k, n), split(v, n), split(g.astype(q.dtype), n, kvh)
    qp, kp = q_pos.reshape(q_pos.shape[0], n, -1), kv_pos.reshape(kv_pos.shape[0], n, -1)
    delta = softmax_delta(g, out, n, kvh)
    i = lax.axis_index(CP)

    def step(carry, kv, s, first):
        dq, dkv = carry
        if not first:
            dkv = _shift(dkv, cp)  # block j's dK/dV, accumulated by the devices before, follow it
        grads = (dq, *dkv)
        for qh, kh, visible in _pairs(layout, i, (i - s) % cp, first, qp, kp):
            grads = fold_grad(grads, qs, *kv, dos, lse, delta, qh, kh, visible)
        return grads[0], grads[1:]

    zeros_kv = jnp.zeros_like(ks, dtype=F32)
    dq, dkv = _ring_loop(step, (jnp.zeros_like(qs, dtype=F32), (zeros_kv, zeros_kv)), (ks, vs), cp)
    if cp > 1:
        dkv = _shift(dkv, cp)  # after step cp-1 device i holds block i+1's gradients: send them home
    dk, dv = (d.astype(k.dtype).reshape(k.shape) for d in dkv)
    return dq.astype(q.dtype).reshape(q.shape), dk, dv


def ring_attention(mesh: Mesh, layout: str = "zigzag", custom_backward: bool = True) -> AttentionFn:
    """An `AttentionFn` for sequences split over `cp` in `layout` (the batch's positions must
    follow it: the DataIterator with `sequence_layout=zigzag_layout(cp)` does that).

    `custom_backward=False` lets autodiff differentiate the forward ring instead (it stores every
    received K/V block; kept to measure what the custom backward saves).
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"context-parallel layout {layout!r} is unknown; choose one of {', '.join(LAYOUTS)}.")
    cp = mesh.shape[CP]
    chunks = 2 * cp if layout == "zigzag" else cp
    # Every argument and result is [B, T or chunks, ...] with that axis split over cp (the local
    # lse [B, n, c, KV, G] concatenates over devices on axis 1 too); batch and heads stay
    # automatic, so dp and tp keep working inside.
    seq = P(None, CP)

    forward, backward = (functools.partial(f, cp=cp, layout=layout) for f in (_forward, _backward))
    ring = recomputing_vjp(forward, backward, mesh)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        if q.shape[1] % chunks:
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by {chunks}, the number of "
                              f"{layout} chunks for mesh.cp={cp}; change train.seq_len.")
        if custom_backward:
            return ring(q, k, v, q_pos, kv_pos)
        return rules.per_device(lambda *a: forward(*a)[0], mesh, seq, seq)(q, k, v, q_pos, kv_pos)
    return attention


# ---------------------------------------------------------------------------------------------
# The strategies (context.strategy)
# ---------------------------------------------------------------------------------------------

def validate_strategy(strategy: str, mc: Any, num_heads: int, kv_heads: int) -> None:
    """A one-line ConfigError unless `strategy` works on mesh `mc` (a MeshConfig) with these heads."""
    if strategy == "ulysses":
        from pjax.parallel.ulysses import validate_heads

        validate_heads(num_heads, kv_heads, mc.cp, mc.tp)


def context_attention(mesh: Mesh, strategy: str, local: AttentionFn) -> AttentionFn:
    """The `AttentionFn` of `context.strategy` for sequences split over cp in the zigzag layout:
    'ring' (this module), 'all_gather' (context_gather.py) or 'ulysses' (ulysses.py, which runs
    `local`, the backend's own attention, on its heads)."""
    if strategy == "ring":
        return ring_attention(mesh)
    if strategy == "all_gather":
        from pjax.parallel.context_gather import all_gather_attention

        return all_gather_attention(mesh)
    if strategy == "ulysses":
        from pjax.parallel.ulysses import ulysses_attention

        return ulysses_attention(mesh, local)
    raise ConfigError(f"context.strategy={strategy!r} is unknown; choose ring, all_gather or ulysses.")
