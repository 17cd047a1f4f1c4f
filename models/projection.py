"""How a decoder layer multiplies one input by its weight matrices (q, k, v share one; gate, up another), and the
`Gemm` each of its three products goes through (plain, or fp8's: `models.fp8.GEMM`).

ARCHITECTURE.md says why: "Weight gradients from a transposed input" (`transposed_projection`)
and "One all-reduce per shared input under TP" (`merge_over_tp`)."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from mesh.backend import target_backend
from mesh.mesh import TP, current
from mesh.rules import auto_size



def _forward(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _prepare(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    return x, w, None


def _multiply(a: jax.Array, b: jax.Array, scale: None, out=None) -> jax.Array:
    del scale
    return jnp.matmul(a, b, preferred_element_type=out)


def _input_product(g: jax.Array, w: jax.Array, out=None) -> jax.Array:
    return jnp.einsum("nf,df->nd", g, w, preferred_element_type=out)


def _weight_product(xt: jax.Array, g: jax.Array, out=None) -> jax.Array:
    return jnp.matmul(xt, g, preferred_element_type=out)


class Gemm(NamedTuple):
    """A projection's three products. `forward` is Y = X W, differentiable. Forms with a hand-written backward
    take Y = X W as `multiply(*prepare(x, w))` (`prepare` gives the operands and their scale, which a shard_map
    can take in: see `sequence_parallel.row`), and `input_grad` dX = dY W^T (g [N, F], w [D, F]) and
    `weight_grad` dW = X^T dY (xt [D, N], g [N, F]); each but `forward` takes an optional result dtype. These
    multiply in the operands' dtype; `models.fp8.GEMM`'s read fp8. With `merged`, weights that share an input
    (q, k, v; gate, up) multiply as one merged GEMM on every layout, not only under tp: one per-tensor scale
    for them, and one for their cotangents, as a fused QKV weight has (fp8's)."""

    forward: Callable[[jax.Array, jax.Array], jax.Array] = _forward
    prepare: Callable[[jax.Array, jax.Array], tuple] = _prepare
    multiply: Callable[..., jax.Array] = _multiply
    input_grad: Callable[..., jax.Array] = _input_product
    weight_grad: Callable[..., jax.Array] = _weight_product
    merged: bool = False


PLAIN = Gemm()


class Quantized(NamedTuple):
    """A weight whose fp8 form its step made once, before the micro-batch loop (`models/fp8_weights.py`): an fp8
    GEMM reads `q` times `scale` (one power of two per layer and merged GEMM) and its gradient goes to `w`, whose
    values nothing reads (it gives the gradient's dtype and its path to the fp32 master). Shaped like `w`."""

    w: jax.Array
    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    def astype(self, dtype) -> "Quantized":
        return self._replace(w=self.w.astype(dtype))

    def reshape(self, *shape: int) -> "Quantized":
        return self._replace(w=self.w.reshape(*shape), q=self.q.reshape(*shape))


def cotangent(w, dw: jax.Array):
    """dW as a custom_vjp returns it for the weight `w` (an array or `Quantized`, of which only the dtype is read):
    in w's dtype, and for a `Quantized` weight none for its fp8 form, a constant of the step."""
    if isinstance(w, Quantized):
        return Quantized(dw.astype(w.dtype), None, None)
    return dw.astype(w.dtype)


ProjectFn = Callable[..., tuple[jax.Array, ...]]  # (x, ws, gemm=PLAIN) -> one output per w


def _tp() -> int:
    return auto_size(current(), TP)


def merge_over_tp(arrays: Sequence[jax.Array], tp: int) -> jax.Array:
    """[..., F_i] arrays split over tp -> [..., sum F_i], each device's blocks side by side (local). `Quantized`
    weights merge their fp8 forms too, which share one scale (`models/fp8_weights.py` quantized them merged)."""
    if isinstance(arrays[0], Quantized):
        return Quantized(*(merge_over_tp([getattr(a, f) for a in arrays], tp) for f in ("w", "q")), arrays[0].scale)
    lead = arrays[0].shape[:-1]
    return jnp.concatenate([a.reshape(*lead, tp, a.shape[-1] // tp) for a in arrays], axis=-1).reshape(*lead, -1)


def split_over_tp(y: jax.Array, widths: Sequence[int], tp: int) -> tuple[jax.Array, ...]:
    """The inverse of `merge_over_tp`: [..., sum F_i] -> the [..., F_i] arrays."""
    lead, blocks = y.shape[:-1], y.reshape(*y.shape[:-1], tp, -1)
    ends = [sum(widths[:i + 1]) // tp for i in range(len(widths))]
    parts = jnp.split(blocks, ends[:-1], axis=-1)
    return tuple(part.reshape(*lead, w) for part, w in zip(parts, widths))


def merges(gemm: Gemm, n: int) -> bool:
    """Whether n weights that share an input multiply as one merged GEMM: under tp, or by `gemm.merged`."""
    return n > 1 and (_tp() > 1 or gemm.merged)


def plain_projection(x: jax.Array, ws: Sequence[jax.Array], gemm: Gemm = PLAIN) -> tuple[jax.Array, ...]:
    """x [N, D] times each w [D, F_i]; under tp one dot, so that autodiff's backward transposes one dot."""
    if not merges(gemm, len(ws)):
        return tuple(gemm.forward(x, w) for w in ws)
    tp = _tp()
    return split_over_tp(gemm.forward(x, merge_over_tp(ws, tp)), [w.shape[-1] for w in ws], tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def transposed_projection(x: jax.Array, ws: Sequence[jax.Array], gemm: Gemm = PLAIN) -> tuple[jax.Array, ...]:
    """`plain_projection`, with weight gradients taken from one materialised x^T (fast on XLA:CPU)."""
    return plain_projection(x, ws, gemm)


def _fwd(x, ws, gemm):
    return plain_projection(x, ws, gemm), (x, ws)


def weight_grads(x: jax.Array, gs: Sequence[jax.Array], ws: Sequence[jax.Array], gemm: Gemm = PLAIN
                 ) -> tuple[jax.Array, ...]:
    """dW_i = x^T @ g_i in each w_i's dtype (as `cotangent`); on XLA:CPU from one materialised x^T."""
    # On XLA:CPU x^T materialised once (behind a barrier, or XLA folds it back into each dot); elsewhere the
    # transpose folds into the dots' dimensions.
    xt = jax.lax.optimization_barrier(x.T) if target_backend() == "cpu" else x.T
    return tuple(cotangent(w, dw) for dw, w in zip(weight_products(xt, gs, gemm), ws))


def weight_products(xt: jax.Array, gs: Sequence[jax.Array], gemm: Gemm = PLAIN) -> tuple[jax.Array, ...]:
    """dW_i = x^T g_i (xt [D, N]), in the product's dtype; by a `merged` gemm one product of the merged g's."""
    if not (gemm.merged and len(gs) > 1):
        return tuple(gemm.weight_grad(xt, g) for g in gs)
    tp = _tp()
    return split_over_tp(gemm.weight_grad(xt, merge_over_tp(gs, tp)), [g.shape[-1] for g in gs], tp)


def input_grad(x: jax.Array, gs: Sequence[jax.Array], ws: Sequence[jax.Array], gemm: Gemm = PLAIN) -> jax.Array:
    """dx = sum_i g_i @ w_i^T in x's dtype; under tp one dot over the merged operands: one all-reduce."""
    if merges(gemm, len(ws)):
        tp = _tp()
        d_x = gemm.input_grad(merge_over_tp(gs, tp), merge_over_tp(ws, tp))
    else:
        d_x = sum(gemm.input_grad(g, w) for g, w in zip(gs, ws))
    return d_x.astype(x.dtype)


def _bwd(gemm, res, gs):
    x, ws = res
    return input_grad(x, gs, ws, gemm), type(ws)(weight_grads(x, gs, ws, gemm))


transposed_projection.defvjp(_fwd, _bwd)


def select_projection(remat: str = "none") -> ProjectFn:
    """The transposed form on XLA:CPU without remat, else the plain one (`dots` policies keep no custom_vjp call)."""
    return transposed_projection if target_backend() == "cpu" and remat == "none" else plain_projection
