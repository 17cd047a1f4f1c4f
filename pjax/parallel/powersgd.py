"""PowerSGD (Vogels et al., 2019): a gradient matrix summed over the data axes as a rank-r product, with error
feedback; `train.grad_compression=powersgd`, `train.powersgd_rank`.

Each replica i holds M_i = its gradient + its residual, as [rows, cols] (a stacked layer weight: one matrix per
layer). One power iteration, warm-started from last step's Q (as PyTorch's DDP hook with warm_start):
  P = psum(M_i Q)            [rows, r]   the only values that cross the links, with
  P = orthonormal(P)                      (a QR of the small [rows, r])
  Q' = psum(M_i^T P)         [cols, r]   these: (rows + cols) r numbers instead of rows x cols
  sum = P Q'^T               the rank-r image of sum M_i: P P^T sum M_i
  residual_i = M_i - P P^T M_i            so sum of the residuals + the reduced sum = sum M_i exactly.
Vectors (norm scales) are summed exactly, as the hook does; a matrix's rows are its input dimensions and its
columns the output ones (`split`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def split(names: tuple[str | None, ...]) -> tuple[int, int] | None:
    """(batch dims, index of the first column dim) for a weight with these logical names, or None for a vector
    (nothing to compress). A leading 'layers' is a batch of matrices; a trailing 'embed' alone is the output of
    an input group (o, down projections), otherwise the first dimension is the input (q/k/v, gate/up, embeddings)."""
    batch = 1 if names and names[0] == "layers" else 0
    if len(names) - batch < 2:
        return None
    return batch, (len(names) - 1 if names[-1] == "embed" else batch + 1)


def q_shape(shape: tuple[int, ...], names: tuple[str | None, ...], rank: int) -> tuple[int, ...]:
    """Q's shape for a (per-device) gradient block of `shape`: [*batch, cols, r], r = rank at most min(rows, cols)
    (at min(rows, cols) the product is the exact sum)."""
    batch, first_col = split(names)
    rows, cols = math.prod(shape[batch:first_col]), math.prod(shape[first_col:])
    return (*shape[:batch], cols, min(rank, rows, cols))


def powersgd_sum(x: jax.Array, residual: jax.Array, q: jax.Array, axes: tuple[str, ...],
                 names: tuple[str | None, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the rank-r sum of x + residual over the manual `axes`, the new residual, the next Q), inside a shard_map
    manual over `axes`; every device ends with the same sum and Q."""
    batch, first_col = split(names)
    shape = x.shape
    m = (x.astype(jnp.float32) + residual).reshape(*shape[:batch], math.prod(shape[batch:first_col]), -1)
    p = lax.psum(m @ q, axes)
    p = jnp.linalg.qr(p)[0]  # orthonormal columns: the sum's image is its projection onto them
    mine = jnp.swapaxes(m, -1, -2) @ p  # [*batch, cols, r]: this replica's M_i^T P
    q_next = lax.psum(mine, axes)
    total = p @ jnp.swapaxes(q_next, -1, -2)
    error = m - p @ jnp.swapaxes(mine, -1, -2)
    return total.reshape(shape), error.reshape(shape), q_next


def initial_q(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A first Q: standard normal (every replica draws the same), as the hook seeds it."""
    return jax.random.normal(key, shape, jnp.float32)
