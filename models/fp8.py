"""fp8 GEMMs for the layer's projections and experts: operands in e4m3, the output's cotangent in e5m2, each with
one per-tensor power-of-two scale from its current amax, handed to the dot as fp8 arrays (ARCHITECTURE.md, "fp8 GEMMs").
A scale belongs to one data replica's block of a tensor: where a manual region splits a sequence's tokens over
devices (cp, or tp under sequence parallelism) the amax is taken over those blocks, never over the batch axes, so a
layout with n data replicas scales as one device running n times the micro-batches does."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh.errors import ConfigError
from mesh.mesh import CP, DP, EP, PP, RP
from models.projection import PLAIN, Gemm, Quantized, cotangent

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
WEIGHT_SCOPE = "fp8_weight"
_F32 = jnp.float32


def _largest(fp8: jnp.dtype) -> float:
    # Constants enter as literals, never as operations of their own (`jnp.where`, `jnp.clip` convert theirs
    # inside): differentiated inside a shard_map nested in another (sequence parallelism's in a data-parallel
    # step), an operation on constants alone becomes a residual whose sharding Shardy refuses (jax 0.10.2).
    return float(jnp.finfo(fp8).max)


BATCH_AXES = (RP, DP, EP)  # the axes that split a batch's rows (mesh/mesh.py)


def whole_amax(x: jax.Array, copies: tuple[str, ...] = ()) -> jax.Array:
    """x's largest magnitude over one data replica's block of it: over the devices whose blocks of it a manual
    region holds (the axes x varies over; an automatic axis's split XLA reduces itself) but the batch axes, where
    each replica's rows are a micro-batch of their own and its GEMMs read only them; not over pp (its devices hold
    other layers); not over `copies`, manual axes along which x's blocks are known to be alike. A constant to
    autodiff: a scale is no function of x to differentiate (MAML's second derivative would reach the pmax)."""
    amax = lax.stop_gradient(jnp.max(jnp.abs(x)).astype(_F32))
    skip = {PP, *BATCH_AXES, *copies}
    split = tuple(sorted(ax for ax in jax.typeof(x).manual_axis_type.varying if ax not in skip))
    return lax.pmax(amax, split) if split else amax


def scale_of(x: jax.Array, fp8: jnp.dtype, amax: jax.Array | None = None) -> jax.Array:
    """The per-tensor scale of x: the least power of two that maps x's largest magnitude (`amax`, by default
    `whole_amax(x)`) within fp8's largest finite value (1 for zeros). A power of two is exact in every dtype, so
    quantizing divides and dequantizing multiplies by the same number, and neither rounds."""
    amax = whole_amax(x) if amax is None else amax
    ratio = amax / _largest(fp8) + (amax <= 0).astype(_F32)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(ratio), exponent - (mantissa == 0.5).astype(exponent.dtype))


def quantize(x: jax.Array, fp8: jnp.dtype, amax: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `fp8`, scale), the scale from `amax` as `scale_of`'s: clipped first, since e4m3fn has no
    infinity and overflows to NaN."""
    scale, top = scale_of(x, fp8, amax), _largest(fp8)
    bound = lambda v: np.asarray(v, x.dtype)  # noqa: E731
    return lax.clamp(bound(-top), x / scale.astype(x.dtype), bound(top)).astype(fp8), scale


def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize(w, E4M3)` for a dense weight. A GEMM reads a dense weight whole but for tp's blocks, so where a
    manual region types it varying over cp (cast for its gradient's sake, `mesh.rules.vary`) its blocks there are
    copies: its amax is exchanged over tp's blocks only."""
    with jax.named_scope(WEIGHT_SCOPE):  # how often a step quantizes its weights, read from the compiled program
        return quantize(w, E4M3, whole_amax(w, copies=(CP,)))


def weight_operand(w: jax.Array | Quantized) -> tuple[jax.Array, jax.Array]:
    """A dense weight in e4m3 and its scale: a `Quantized` weight's, made once per step, or `quantize_weight`'s."""
    return (w.q, w.scale) if isinstance(w, Quantized) else quantize_weight(w)


def expert_operand(w: jax.Array | Quantized) -> tuple[jax.Array, jax.Array]:
    """A device's expert weights in e4m3 and their one scale: a `Quantized` weight's, made once per step (its one
    block's scale), or `quantize`'s; experts over ep are each device's own, so no amax crosses devices."""
    return (w.q, w.scale.reshape(())) if isinstance(w, Quantized) else quantize(w, E4M3)


def _shape_of(w: jax.Array | Quantized):
    """What a backward needs of a weight to return its gradient (`projection.cotangent`): empty, its dtype kept."""
    return jax.tree.map(lambda a: jnp.zeros((0,), a.dtype), w)


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The fp8 values back in `dtype`, times their scale."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """x as an fp8 GEMM reads it: quantized to `fp8` with its current scale and dequantized."""
    return dequantize(*quantize(x, fp8), x.dtype)


def _scaled(product, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`product` of two fp8 arrays written in `dtype`, times their scales' product (a power of two: exact): the dot
    reads fp8 operands, so XLA:GPU runs it as one fp8 GEMM (cuBLASLt's, the scale fused, writing `dtype`)."""
    return product(a, b, dtype) * scale.astype(dtype)


def _typed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent summed over the manual axes it varies over and its primal does not (a weight replicated over
    cp, its gradient from cp's tokens): a custom_vjp's cotangent has its primal's type, as autodiff's would."""
    extra = jax.typeof(ct).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying
    return lax.psum(ct, tuple(sorted(extra))) if extra else ct


def _dot(contract: tuple[int, int]):
    return lambda a, b, out: lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                                              preferred_element_type=out)


_XW, _GWT, _XTG = _dot((1, 0)), _dot((1, 1)), _dot((0, 0))  # X W, dY W^T, X^T dY


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, D] @ w [D, F] in x's dtype with e4m3 operands; both backward GEMMs read the cotangent in e5m2 and
    the operands as the forward stored them, in fp8."""
    return _matmul_fwd(x, w)[0]


def _matmul_fwd(x, w):
    (xq, sx), (wq, sw) = quantize(x, E4M3), weight_operand(w)
    return _scaled(_XW, xq, wq, sx * sw, x.dtype), (xq, sx, wq, sw, _shape_of(w))


def _matmul_bwd(res, g):
    xq, sx, wq, sw, w_like = res
    gq, sg = quantize(g, E5M2)
    return (_typed_like(_scaled(_GWT, gq, wq, sg * sw, g.dtype), xq),
            cotangent(w_like, _typed_like(_scaled(_XTG, xq, gq, sx * sg, w_like.dtype), wq)))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def prepare(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The operands of Y = X W (x [N, D], w [D, F]) in e4m3, and their scales' product."""
    (xq, sx), (wq, sw) = quantize(x, E4M3), weight_operand(w)
    return xq, wq, sx * sw


def multiply(xq: jax.Array, wq: jax.Array, scale: jax.Array, out: jnp.dtype) -> jax.Array:
    """Y = X W from `prepare`'s operands, as an e4m3 GEMM, in `out`."""
    return _scaled(_XW, xq, wq, scale, out)


def input_grad(g: jax.Array, w: jax.Array, out=None) -> jax.Array:
    """dX = dY W^T (g [N, F], w [D, F]) as an e5m2 x e4m3 GEMM, for a hand-written backward."""
    (gq, sg), (wq, sw) = quantize(g, E5M2), weight_operand(w)
    return _scaled(_GWT, gq, wq, sg * sw, out or g.dtype)


def weight_grad(xt: jax.Array, g: jax.Array, out=None) -> jax.Array:
    """dW = X^T dY (xt [D, N], g [N, F]) as an e4m3 x e5m2 GEMM, for a hand-written backward."""
    (xq, sx), (gq, sg) = quantize(xt, E4M3), quantize(g, E5M2)
    return _scaled(_XW, xq, gq, sx * sg, out or g.dtype)


GEMM = Gemm(matmul, prepare, multiply, input_grad, weight_grad, merged=True)


def gemm(enabled: bool) -> Gemm:
    """The projections' products: fp8's under `precision.fp8`, else the plain ones."""
    return GEMM if enabled else PLAIN


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The experts' batched GEMM `jnp.einsum(subscripts, x, w)` (each index in two of the three terms) in fp8."""
    return _einsum_fwd(subscripts, x, w)[0]


def _einsum_fwd(subscripts, x, w):
    (xq, sx), (wq, sw) = quantize(x, E4M3), expert_operand(w)
    product = lambda a, b, out: jnp.einsum(subscripts, a, b, preferred_element_type=out)  # noqa: E731
    return _scaled(product, xq, wq, sx * sw, x.dtype), (xq, sx, wq, sw, _shape_of(w))


def _einsum_bwd(subscripts, res, g):
    xq, sx, wq, sw, w_like = res
    gq, sg = quantize(g, E5M2)
    a, rest = subscripts.split(",")
    b, c = rest.split("->")
    over = lambda spec: lambda p, q, out: jnp.einsum(spec, p, q, preferred_element_type=out)  # noqa: E731
    return (_typed_like(_scaled(over(f"{c},{b}->{a}"), gq, wq, sg * sw, g.dtype), xq),
            cotangent(w_like, _typed_like(_scaled(over(f"{a},{c}->{b}"), xq, gq, sx * sg, w_like.dtype), wq)))


einsum.defvjp(_einsum_fwd, _einsum_bwd)

# dW of a grouped GEMM: rows of x and dY grouped alike, each group's x^T dY its expert's [D, F].
_GROUPED_WEIGHT_GRAD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@jax.custom_vjp
def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The experts' grouped GEMM (`lax.ragged_dot`, rows sorted by expert) in fp8: one scale per tensor."""
    return _ragged_fwd(x, w, group_sizes)[0]


def _ragged_fwd(x, w, group_sizes):
    (xq, sx), (wq, sw) = quantize(x, E4M3), expert_operand(w)
    product = lambda a, b, out: lax.ragged_dot(a, b, group_sizes, preferred_element_type=out)  # noqa: E731
    return _scaled(product, xq, wq, sx * sw, x.dtype), (xq, sx, wq, sw, group_sizes, _shape_of(w))


def _ragged_bwd(res, g):
    xq, sx, wq, sw, group_sizes, w_like = res
    gq, sg = quantize(g, E5M2)
    d_x = lambda a, b, out: lax.ragged_dot(a, b.swapaxes(1, 2), group_sizes, preferred_element_type=out)  # noqa: E731
    d_w = lambda a, b, out: lax.ragged_dot_general(a, b, group_sizes, _GROUPED_WEIGHT_GRAD,  # noqa: E731
                                                   preferred_element_type=out)
    return (_typed_like(_scaled(d_x, gq, wq, sg * sw, g.dtype), xq),
            cotangent(w_like, _typed_like(_scaled(d_w, xq, gq, sx * sg, w_like.dtype), wq)), None)


ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def check() -> None:
    """A ConfigError where fp8 GEMMs cannot run: a GPU before Hopper/Ada (compute capability < 8.9).
    XLA:CPU emulates fp8."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability is not None and tuple(map(int, capability.split("."))) < (8, 9):
        raise ConfigError(f"precision.fp8=true needs fp8 GEMMs (compute capability 8.9 or newer: H100, L40S, "
                          f"RTX 4090), and this {device.device_kind} has {capability}; use precision.preset=bf16.")
