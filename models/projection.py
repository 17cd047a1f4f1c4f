"""How a decoder layer multiplies one input by its weight matrices, and why XLA:CPU gets its own form.

Every projection in the layer is `x @ w` with x a [tokens, D] activation: q, k and v share one
input, gate and up another, o and down have one each. The forward is the same everywhere. What
differs is the backward's weight gradient dW = x^T @ g, which contracts over the tokens, the
leading dimension of both x [N, D] and g [N, F]. cuBLAS reads a transposed operand for free, but
XLA:CPU hands this "transposed-left" product to its dot kernels as it is and runs it at 90-205
GFLOP/s. The same product with x transposed first ([D, N] @ [N, F]) runs at 160-227 GFLOP/s on
this repo's shapes (N = 1024, D = 256, F = 128/256/688).

`transposed_projection` is a `custom_vjp` that forms x^T once per input, behind an optimization
barrier so XLA cannot fold it back into the dot, and takes each dW_i = x^T @ g_i from it. The
projections that share an input share the transpose. On the picotron-cpu step this made one
device 4.3% faster, dp=2 3.2%, tp=2 2.7%, cp=2 3.2% and pp=2 2.4% (interleaved A/B runs,
identical losses).

Under tensor parallelism the weights sharing an input are split over tp on their output
dimension, so each device's share of dx = sum_i g_i @ w_i^T is a partial sum that tp must add up.
Computed as separate dots, XLA all-reduces each product before the sum: three all-reduces for
q, k, v and two for gate, up, where Megatron's `f` operator does one. With tp > 1 both forms
therefore take dx from one dot over the operands merged along F (`merge_over_tp`: each device's
blocks side by side, so the merge is local), and XLA all-reduces it once; the plain form also
runs its forward as that one dot, so that autodiff's backward has the one dot to transpose.

Under remat policies the plain form stays: the `dots` policies pick what to keep by the
primitive, and a `custom_vjp` call is no dot, so its outputs would be recomputed instead of kept;
under `full` (pp=2 with remat) the transposed form measured 1-2% slower.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from mesh.mesh import TP
from mesh.rules import auto_size

ProjectFn = Callable[[jax.Array, Sequence[jax.Array]], tuple[jax.Array, ...]]


def _tp() -> int:
    return auto_size(jax.sharding.get_abstract_mesh(), TP)


def merge_over_tp(arrays: Sequence[jax.Array], tp: int) -> jax.Array:
    """[..., F_i] arrays, each split over tp on its last dimension -> one [..., sum F_i] whose k-th
    tp block holds every array's k-th block: a concatenation that moves nothing between devices."""
    lead = arrays[0].shape[:-1]
    return jnp.concatenate([a.reshape(*lead, tp, a.shape[-1] // tp) for a in arrays], axis=-1).reshape(*lead, -1)


def split_over_tp(y: jax.Array, widths: Sequence[int], tp: int) -> tuple[jax.Array, ...]:
    """The inverse of `merge_over_tp`: [..., sum F_i] -> the [..., F_i] arrays."""
    lead, blocks = y.shape[:-1], y.reshape(*y.shape[:-1], tp, -1)
    ends = [sum(widths[:i + 1]) // tp for i in range(len(widths))]
    parts = jnp.split(blocks, ends[:-1], axis=-1)
    return tuple(part.reshape(*lead, w) for part, w in zip(parts, widths))


def plain_projection(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """x [N, D] times each w [D, F_i]: autodiff's backward (what GPUs and remat policies want);
    one dot for all of them under tensor parallelism (see the module doc)."""
    tp = _tp()
    if tp == 1 or len(ws) == 1:
        return tuple(x @ w for w in ws)
    return split_over_tp(x @ merge_over_tp(ws, tp), [w.shape[-1] for w in ws], tp)


@jax.custom_vjp
def transposed_projection(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """`plain_projection`, with weight gradients taken from one materialised x^T (fast on XLA:CPU)."""
    return plain_projection(x, ws)


def _fwd(x, ws):
    return plain_projection(x, ws), (x, ws)


def weight_grads(x: jax.Array, gs: Sequence[jax.Array], ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """dW_i = x^T @ g_i in each w_i's dtype; on XLA:CPU from one materialised x^T (see the module doc)."""
    if jax.default_backend() != "cpu":
        return tuple(jnp.einsum("nd,nf->df", x, g).astype(w.dtype) for g, w in zip(gs, ws))
    xt = jax.lax.optimization_barrier(x.T)  # [D, N], once for all weights that share x
    return tuple((xt @ g).astype(w.dtype) for g, w in zip(gs, ws))


def input_grad(x: jax.Array, gs: Sequence[jax.Array], ws: Sequence[jax.Array]) -> jax.Array:
    """dx = sum_i g_i @ w_i^T in x's dtype; under tp one dot over the merged operands, so one
    all-reduce of its partial sum (see the module doc)."""
    tp = _tp()
    if tp > 1 and len(ws) > 1:
        d_x = jnp.einsum("nf,df->nd", merge_over_tp(gs, tp), merge_over_tp(ws, tp))
    else:
        d_x = sum(jnp.einsum("nf,df->nd", g, w) for g, w in zip(gs, ws))
    return d_x.astype(x.dtype)


def _bwd(res, gs):
    x, ws = res
    return input_grad(x, gs, ws), type(ws)(weight_grads(x, gs, ws))


transposed_projection.defvjp(_fwd, _bwd)


def select_projection(remat: str = "none") -> ProjectFn:
    """The transposed form on XLA:CPU without remat, the plain one otherwise (see the module doc)."""
    return transposed_projection if jax.default_backend() == "cpu" and remat == "none" else plain_projection
