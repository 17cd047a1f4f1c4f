"""fp8 matmuls for the layer's projections: operands rounded through e4m3, the output's cotangent through
e5m2, each with one per-tensor scale from its current amax (ARCHITECTURE.md, "fp8 matmuls")."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from mesh.errors import ConfigError

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_F32 = jnp.float32


def scale_of(x: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """The per-tensor scale that maps x's largest magnitude onto fp8's largest finite value (1 for zeros)."""
    amax = jnp.max(jnp.abs(x)).astype(_F32)
    return jnp.where(amax > 0, amax / jnp.finfo(fp8).max.astype(_F32), 1.0)


def quantize(x: jax.Array, fp8: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in `fp8`, scale): clipped first, since e4m3fn has no infinity and overflows to NaN."""
    scale = scale_of(x, fp8)
    top = jnp.finfo(fp8).max.astype(x.dtype)
    return jnp.clip(x / scale.astype(x.dtype), -top, top).astype(fp8), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The fp8 values back in `dtype`, times their scale: the form XLA:GPU fuses into an fp8 GEMM."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fp8: jnp.dtype) -> jax.Array:
    """x as an fp8 GEMM reads it: quantized to `fp8` with its current scale and dequantized."""
    return dequantize(*quantize(x, fp8), x.dtype)


@jax.custom_vjp
def operand(x: jax.Array) -> jax.Array:
    """A GEMM operand in e4m3; its gradient passes straight through (the rounding has none)."""
    return round_trip(x, E4M3)


operand.defvjp(lambda x: (round_trip(x, E4M3), None), lambda _, g: (g,))


@jax.custom_vjp
def cotangent(y: jax.Array) -> jax.Array:
    """The identity on a GEMM's output; its cotangent, which the backward GEMMs read, in e5m2."""
    return y


cotangent.defvjp(lambda y: (y, None), lambda _, g: (round_trip(g, E5M2),))


def projections(column: Callable, row: Callable) -> tuple[Callable, Callable]:
    """The layer's (column, row) projection forms with fp8 operands and e5m2 output cotangents: every
    GEMM of the forward and both backward ones (dX = dY W^T, dW = X^T dY) reads fp8 values."""
    def fp8_column(y: jax.Array, ws: Sequence[jax.Array], site: str) -> tuple[jax.Array, ...]:
        return tuple(cotangent(o) for o in column(operand(y), [operand(w) for w in ws], site))

    def fp8_row(y: jax.Array, w: jax.Array, site: str) -> jax.Array:
        return cotangent(row(operand(y), operand(w), site))

    return fp8_column, fp8_row


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The experts' batched GEMM (`jnp.einsum` of an input and a weight) in fp8."""
    return cotangent(jnp.einsum(subscripts, operand(x), operand(w)))


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The experts' grouped GEMM (`lax.ragged_dot`, rows sorted by expert) in fp8: one scale per tensor."""
    return cotangent(jax.lax.ragged_dot(operand(x), operand(w), group_sizes))


def check() -> None:
    """A ConfigError where fp8 GEMMs cannot run: a GPU before Hopper/Ada (compute capability < 8.9).
    XLA:CPU emulates fp8."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability is not None and tuple(map(int, capability.split("."))) < (8, 9):
        raise ConfigError(f"precision.fp8=true needs fp8 GEMMs (compute capability 8.9 or newer: H100, L40S, "
                          f"RTX 4090), and this {device.device_kind} has {capability}; use precision.preset=bf16.")
