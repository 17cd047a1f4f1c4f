"""How a decoder layer multiplies one input by its weight matrices (q, k, v share one; gate, up another).

ARCHITECTURE.md says why: "Weight gradients from a transposed input" (`transposed_projection`)
and "One all-reduce per shared input under TP" (`merge_over_tp`)."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from mesh.backend import target_backend
from mesh.mesh import TP, current
from mesh.rules import auto_size

ProjectFn = Callable[[jax.Array, Sequence[jax.Array]], tuple[jax.Array, ...]]


def _tp() -> int:
    return auto_size(current(), TP)


def merge_over_tp(arrays: Sequence[jax.Array], tp: int) -> jax.Array:
    """[..., F_i] arrays split over tp -> [..., sum F_i], each device's blocks side by side (local)."""
    lead = arrays[0].shape[:-1]
    return jnp.concatenate([a.reshape(*lead, tp, a.shape[-1] // tp) for a in arrays], axis=-1).reshape(*lead, -1)


def split_over_tp(y: jax.Array, widths: Sequence[int], tp: int) -> tuple[jax.Array, ...]:
    """The inverse of `merge_over_tp`: [..., sum F_i] -> the [..., F_i] arrays."""
    lead, blocks = y.shape[:-1], y.reshape(*y.shape[:-1], tp, -1)
    ends = [sum(widths[:i + 1]) // tp for i in range(len(widths))]
    parts = jnp.split(blocks, ends[:-1], axis=-1)
    return tuple(part.reshape(*lead, w) for part, w in zip(parts, widths))


def plain_projection(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """x [N, D] times each w [D, F_i]; under tp one dot, so that autodiff's backward transposes one dot."""
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
    """dW_i = x^T @ g_i in each w_i's dtype; on XLA:CPU from one materialised x^T."""
    if target_backend() != "cpu":
        return tuple(jnp.einsum("nd,nf->df", x, g).astype(w.dtype) for g, w in zip(gs, ws))
    xt = jax.lax.optimization_barrier(x.T)  # or XLA folds it back into the dot
    return tuple((xt @ g).astype(w.dtype) for g, w in zip(gs, ws))


def input_grad(x: jax.Array, gs: Sequence[jax.Array], ws: Sequence[jax.Array]) -> jax.Array:
    """dx = sum_i g_i @ w_i^T in x's dtype; under tp one dot over the merged operands: one all-reduce."""
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
    """The transposed form on XLA:CPU without remat, else the plain one (`dots` policies keep no custom_vjp call)."""
    return transposed_projection if target_backend() == "cpu" and remat == "none" else plain_projection
