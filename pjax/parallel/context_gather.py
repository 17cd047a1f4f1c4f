"""Context parallelism by all-gather: each device gathers every key and value over `cp` and
attends its own queries to them (`context.strategy=all_gather`).

The sequence is split over cp in the zigzag layout (`context_parallel.zigzag_layout`): device i
holds chunks i ("early") and 2cp-1-i ("late") of 2cp. Instead of passing K/V blocks around a
ring, the forward all-gathers K and V once -- with their kv-heads only, so under grouped-query
attention this is the small half of the attention inputs -- and each device folds the chunk
pairs its queries need into an online softmax (`online_softmax`):

  * the early query chunk i sees key chunks 0..i-1 whole, and chunk i under a causal mask;
  * the late one, 2cp-1-i, sees chunks 0..2cp-2-i whole, and chunk 2cp-1-i under a mask.

That is 2cp-1 whole pairs on every device (i + 2cp-1-i), run by one fixed-length loop whose
step s is (early, chunk s) while s < i and (late, chunk s-i) after, plus the two masked
diagonal pairs: 2cp+1 pairs, the ring's count, with nothing above the diagonal computed.

The backward (a `custom_vjp`, saving only local q, k, v, the output and the log-sum-exp)
gathers K and V again, recomputes each pair, accumulates dK and dV for the whole sequence in
fp32, and reduce-scatters them back to their owners: the gathered order puts device d's two
chunks at positions 2d and 2d+1, so a tiled `psum_scatter` over cp is exactly "send each chunk's
gradient home".

Communication per call, with one K/V block = B*T/cp*kv_heads*head_dim elements: forward an
all-gather of K and V (2(cp-1) blocks received), backward the same plus a reduce-scatter of dK
and dV (2(cp-1) fp32 blocks): the ring's bytes, in three collectives instead of ~3cp permutes,
with no step waiting on a neighbour. The price is memory: the gathered K/V (and, in the
backward, their fp32 gradients) are the whole sequence's, O(T) per device where the ring holds
two blocks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mesh import rules
from mesh.errors import ConfigError
from mesh.mesh import CP
from models.attention import AttentionFn
from pjax.parallel.online_softmax import F32, causal, finish, fold, fold_grad, softmax_delta, split, start


def _gathered_index(chunk: jax.Array, cp: int) -> jax.Array:
    """Where chunk `chunk` (of 2cp) sits in the gathered order: device d's chunks d, 2cp-1-d at 2d, 2d+1."""
    return jnp.where(chunk < cp, 2 * chunk, 4 * cp - 1 - 2 * chunk)


def _whole_pair(s: jax.Array, i: jax.Array, cp: int) -> tuple[jax.Array, jax.Array]:
    """(query half, gathered key index) of step s of the unmasked loop on device i."""
    late = s >= i
    return late * 1, _gathered_index(jnp.where(late, s - i, s), cp)


def _pairs(cp: int, qp: jax.Array, kp: jax.Array):
    """The loop over the 2cp-1 whole pairs, and the two masked diagonal pairs (half, index, mask)."""
    i = lax.axis_index(CP)
    diagonal = [(h, 2 * i + h, causal(qp, kp, h, h)) for h in (0, 1)]
    return i, diagonal


def _gather(x: jax.Array) -> jax.Array:
    return lax.all_gather(x, CP, axis=1, tiled=True)


def _forward(q, k, v, q_pos, kv_pos, cp: int):
    """Per-device forward: (out [B, T_l, H, D], lse [B, 2, c, KV, G] fp32)."""
    qs, kg, vg = split(q, 2, k.shape[2]), _gather(split(k, 2)), _gather(split(v, 2))
    i, diagonal = _pairs(cp, q_pos.reshape(q_pos.shape[0], 2, -1), kv_pos.reshape(kv_pos.shape[0], 2, -1))

    def whole(s, acc):
        return fold(acc, qs, kg, vg, *_whole_pair(s, i, cp), None)

    acc = lax.fori_loop(0, 2 * cp - 1, whole, start(qs))
    for qh, kh, visible in diagonal:
        acc = fold(acc, qs, kg, vg, qh, kh, visible)
    return finish(acc, q)


def _backward(q, k, v, q_pos, kv_pos, out, lse, g, cp: int):
    """Per-device backward: the pairs again; dK/dV of the whole sequence reduce-scattered home."""
    kvh = k.shape[2]
    qs, dos, kg, vg = split(q, 2, kvh), split(g.astype(q.dtype), 2, kvh), _gather(split(k, 2)), _gather(split(v, 2))
    delta = softmax_delta(g, out, 2, kvh)
    i, diagonal = _pairs(cp, q_pos.reshape(q_pos.shape[0], 2, -1), kv_pos.reshape(kv_pos.shape[0], 2, -1))

    def whole(s, grads):
        return fold_grad(grads, qs, kg, vg, dos, lse, delta, *_whole_pair(s, i, cp), None)

    grads = (jnp.zeros_like(qs, dtype=F32), jnp.zeros_like(kg, dtype=F32), jnp.zeros_like(vg, dtype=F32))
    grads = lax.fori_loop(0, 2 * cp - 1, whole, grads)
    for qh, kh, visible in diagonal:
        grads = fold_grad(grads, qs, kg, vg, dos, lse, delta, qh, kh, visible)
    dq, dkg, dvg = grads
    dk, dv = (lax.psum_scatter(d, CP, scatter_dimension=1, tiled=True).astype(k.dtype).reshape(k.shape)
              for d in (dkg, dvg))
    return dq.astype(q.dtype).reshape(q.shape), dk, dv


def all_gather_attention(mesh: Mesh) -> AttentionFn:
    """An `AttentionFn` for sequences split over `cp` in the zigzag layout, by all-gathered K/V."""
    cp = mesh.shape[CP]
    seq = P(None, CP)  # arguments, results and lse [B, 2, c, KV, G] split over cp on axis 1

    def per_device(fn, out_specs):
        return rules.per_device(functools.partial(fn, cp=cp), mesh, seq, out_specs)

    @jax.custom_vjp
    def attend(q, k, v, q_pos, kv_pos):
        return per_device(_forward, (seq, seq))(q, k, v, q_pos, kv_pos)[0]

    def attend_fwd(q, k, v, q_pos, kv_pos):
        out, lse = per_device(_forward, (seq, seq))(q, k, v, q_pos, kv_pos)
        return out, (q, k, v, q_pos, kv_pos, out, lse)

    def attend_bwd(res, g):
        return (*per_device(_backward, (seq, seq, seq))(*res, g), None, None)

    attend.defvjp(attend_fwd, attend_bwd)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
        if q.shape[1] % (2 * cp):
            raise ConfigError(f"sequence length {q.shape[1]} is not divisible by 2*mesh.cp = {2 * cp}, the "
                              f"number of zigzag chunks; change train.seq_len.")
        return attend(q, k, v, q_pos, kv_pos)
    return attention
