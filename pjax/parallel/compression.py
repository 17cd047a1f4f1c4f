"""Compressed gradient reduction over the data axes: what crosses the links is a bf16 or int8 payload, the sum is
fp32, and what a device's payload failed to carry is its residual, added to its next gradient (error feedback).

A sum over n devices in two phases, one quantization each (a ring would requantize at every hop):
  1. each device cuts its value into n chunks, encodes them and sends chunk j to device j (`all_to_all`);
     device j decodes the n chunks it holds and sums them in fp32: its slice of the sum (a reduce-scatter);
  2. each device encodes its slice and `all_gather`s: everyone decodes the same whole sum.
int8 carries one fp32 scale per block of `BLOCK` values (absmax / 127). `lax.psum` cannot do this: it adds
in its operands' dtype (an int8 psum wraps around, a bf16 one accumulates in bf16).

Error feedback: a device sends encode(g + r) and keeps r' = (g + r) - decode(encode(g + r)); the owner of a
slice adds phase 2's error on it to its own r'. So sum over steps of the reduced values = sum of the exact
sums - sum over devices of the last residuals: the gap stays bounded instead of growing with the steps."""
from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from mesh.errors import ConfigError

Payload = Literal["bf16", "int8"]
# Every device gathers the same whole sum: the invariant gather says so to shard_map's type system, so the sum
# leaves a shard_map as replicated (`out_specs` P()). Public in newer JAX, in jax._src in 0.10.
_all_gather_invariant = getattr(lax, "all_gather_invariant", None) or jax._src.lax.parallel.all_gather_invariant
BLOCK = 256  # int8 values per fp32 scale: 1.6% more bytes, small blocks keep an outlier's damage local
_INT8_MAX = 127.0


def bytes_per_value(mode: str) -> float:
    """Bytes a gradient value occupies on the link under `train.grad_compression=mode` (int8: + its block's scale)."""
    return {"none": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}[mode]


def _axes_size(axes: tuple[str, ...]) -> int:
    size = 1
    for axis in axes:
        size *= lax.axis_size(axis)
    return size


def _encode(x: jax.Array, payload: Payload) -> tuple[jax.Array, jax.Array | None]:
    """fp32 [..., m] (m a multiple of BLOCK for int8) -> (payload values, fp32 scales per block or None)."""
    if payload == "bf16":
        return x.astype(jnp.bfloat16), None
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / _INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(blocks / safe[..., None]), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q.reshape(x.shape), scale


def _decode(values: jax.Array, scale: jax.Array | None) -> jax.Array:
    if scale is None:
        return values.astype(jnp.float32)
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK).astype(jnp.float32)
    return (blocks * scale[..., None]).reshape(values.shape)


def _chunks(x: jax.Array, n: int, payload: Payload) -> jax.Array:
    """x flattened, zero-padded and cut into n rows [n, m], m a multiple of the payload's block."""
    flat = x.astype(jnp.float32).reshape(-1)
    block = BLOCK if payload == "int8" else 1
    width = -(-flat.size // (n * block)) * block
    return jnp.pad(flat, (0, n * width - flat.size)).reshape(n, width)


def _exchange(values: jax.Array, scale: jax.Array | None, axes: tuple[str, ...], gather: bool
              ) -> tuple[jax.Array, jax.Array | None]:
    """Phase 1 (`all_to_all`: row j to device j) or phase 2 (`all_gather` of one row), payload and scales alike.
    bf16 travels as its bits (uint16): XLA:CPU would otherwise widen a bf16 collective to f32."""
    if gather:
        move = lambda a: _all_gather_invariant(a, axes, axis=0, tiled=True)  # noqa: E731
    else:
        move = lambda a: lax.all_to_all(a, axes, 0, 0, tiled=True)  # noqa: E731
    if values.dtype == jnp.bfloat16:
        moved = lax.bitcast_convert_type(move(lax.bitcast_convert_type(values, jnp.uint16)), jnp.bfloat16)
    else:
        moved = move(values)
    return moved, None if scale is None else move(scale)


def compressed_sum(x: jax.Array, residual: jax.Array, axes: tuple[str, ...], payload: Payload
                   ) -> tuple[jax.Array, jax.Array]:
    """(the sum of x + residual over the manual `axes`, the new residual), both x's shape; inside a shard_map
    manual over `axes`, each device holding its own x and residual."""
    n = _axes_size(axes)
    rows = _chunks(x + residual, n, payload)
    values, scale = _encode(rows, payload)
    error = rows - _decode(values, scale)  # what this device's payload did not carry
    mine = jnp.sum(_decode(*_exchange(values, scale, axes, gather=False)), axis=0)  # my slice of the sum, fp32
    values, scale = _encode(mine[None], payload)
    owner_error = mine - _decode(values, scale)[0]
    me = _linear_index(axes)
    error = error.at[me].add(owner_error)  # phase 2's error on my slice: mine to carry next time
    total = _decode(*_exchange(values, scale, axes, gather=True))
    unpad = lambda a: a.reshape(-1)[:x.size].reshape(x.shape)  # noqa: E731
    return unpad(total), unpad(error)


def compressed_sum_scatter(x: jax.Array, residual: jax.Array, axis: str | tuple[str, ...], dimension: int,
                           payload: Payload
                           ) -> tuple[jax.Array, jax.Array]:
    """(`lax.psum_scatter(x + residual, axis, scatter_dimension=dimension, tiled=True)` with a compressed
    payload, the new residual): phase 1 alone, so one quantization and no owner error. `axis` may be several
    (dp and ep): their devices in mesh order."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    n = lax.axis_size(axes)
    moved = jnp.moveaxis(x + residual, dimension, 0).astype(jnp.float32)  # chunk j = rows j*d/n .. of `dimension`
    rows = moved.reshape(n, -1)
    if payload == "int8" and rows.shape[1] % BLOCK:
        pad = -rows.shape[1] % BLOCK
        rows = jnp.pad(rows, ((0, 0), (0, pad)))
    values, scale = _encode(rows, payload)
    error = rows - _decode(values, scale)
    mine = jnp.sum(_decode(*_exchange(values, scale, axes, gather=False)), axis=0)
    width = moved[0].size * moved.shape[0] // n
    slice_shape = (moved.shape[0] // n, *moved.shape[1:])
    out = jnp.moveaxis(mine[:width].reshape(slice_shape), 0, dimension)
    error = jnp.moveaxis(error[:, :width].reshape(moved.shape), 0, dimension)
    return out, error


def _linear_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's index along `axes` taken together, in the order `all_to_all` and `all_gather` use."""
    index = jnp.zeros((), jnp.int32)
    for axis in axes:
        index = index * lax.axis_size(axis) + lax.axis_index(axis)
    return index


def check_run(run: Any) -> None:
    """One line where `train.grad_compression` has no once-per-step reduction to compress (one data replica;
    ZeRO-3, which reduce-scatters every micro-batch)."""
    mode, mesh = run.train.grad_compression, run.mesh
    if mode == "none":
        return
    if mesh.dp * mesh.cp == 1:
        raise ConfigError(f"train.grad_compression={mode} compresses the gradient reduction over dp and cp, and this "
                          f"mesh has dp=1, cp=1: set mesh.dp > 1, or train.grad_compression=none.")
    if run.train.zero >= 3:
        raise ConfigError(f"train.grad_compression={mode} with train.zero=3: use train.zero=1 (its reduce-scatter "
                          f"is compressed), or train.grad_compression=none (ZeRO-3 has no once-per-step reduction "
                          f"to compress).")
