"""The experts' grouped GEMM: rows sorted by expert, `group_sizes` rows for each, the rows past them left out.

XLA:GPU (jax 0.10) lowers `lax.ragged_dot` as a dense GEMM over the whole buffer for each group, masked: with a
receive buffer sized for the worst case and several experts per device, that is many times the routed rows' FLOPs
and a [rows, groups, D] temporary. On Hopper GPUs, tokamax's `ragged_dot` (a Pallas Mosaic GPU kernel, and its two
backward GEMMs) reads the group sizes at run time instead. Elsewhere (`kernel` says where), or without tokamax (the
`cuda12`, `cuda13` and `gpu-plan` extras install it), `lax.ragged_dot`. ARCHITECTURE.md, "Dropless under expert
parallelism", says why."""
from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mesh.backend import on_target, target_backend, target_device


@functools.cache
def _tokamax() -> Any:
    try:
        import tokamax
        from absl import flags
    except ImportError:
        return None
    if not flags.FLAGS.is_parsed():  # tokamax's options are absl flags, which would parse pjax's own command line
        flags.FLAGS.mark_as_parsed()
    # A GEMM shape tokamax has no tuned config for takes its heuristic one, and says so at each trace: not the user's.
    logging.getLogger("absl").addFilter(lambda record: "Autotuning cache miss" not in record.getMessage())
    return tokamax


def kernel(x: jax.Array, w: jax.Array) -> str:
    """Which grouped GEMM a step built now traces for x [M, K] and w [G, K, N]: 'tokamax' (its Mosaic GPU kernel)
    where it runs, else 'xla'. Mosaic needs a Hopper or later GPU, and 16-bit operands whose widths K and N fill
    whole 128-byte swizzles (multiples of 64), else its WGMMA does not lower. tokamax's Triton kernel would take
    the rest, but its output type lacks the shard_map varying axes JAX checks, so it cannot run in pjax's steps."""
    if target_backend() != "gpu" or _tokamax() is None:
        return "xla"
    device = target_device() or jax.devices()[0]
    hopper = float(getattr(device, "compute_capability", 0) or 0) >= 9.0
    fits = x.dtype in (jnp.bfloat16, jnp.float16) and x.shape[1] % 64 == 0 and w.shape[2] % 64 == 0
    return "tokamax" if hopper and fits else "xla"


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] rows sorted by group, w [G, K, N], group_sizes [G] -> [M, N]; rows past sum(group_sizes): zero."""
    if kernel(x, w) == "tokamax":
        y = _kernel(x, w, group_sizes)
        filled = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
        return jnp.where(filled[:, None], y, 0)  # the kernel leaves rows past the groups unwritten
    return lax.ragged_dot(x, w, group_sizes)


def _tokamax_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    with on_target():  # tokamax asks the default device whether its kernel runs there
        return _tokamax().ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype, implementation="mosaic")


def _like(t: jax.Array, ref: jax.Array) -> jax.Array:
    """`t` typed as varying over the manual axes `ref` varies over: tokamax's backward drops that type inside a
    shard_map (its values are each device's own)."""
    missing = tuple(jax.typeof(ref).manual_axis_type.varying - jax.typeof(t).manual_axis_type.varying)
    return lax.pcast(t, missing, to="varying") if missing else t


@jax.custom_vjp
def _kernel(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _like(_tokamax_dot(x, w, group_sizes), x)


def _kernel_fwd(x, w, group_sizes):
    return _kernel(x, w, group_sizes), (x, w, group_sizes)


# The backward's two grouped GEMMs, as tokamax's own VJP states them: dX = G W^T per group (ragged rows), and
# dW[g] = X_g^T G_g (the ragged dimension contracted).
_D_X = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                     rhs_group_dimensions=[0])
_D_W = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                     rhs_group_dimensions=[])


def _kernel_bwd(saved, g):
    x, w, group_sizes = saved
    with on_target():
        d_x = _tokamax().ragged_dot_general(g, w, group_sizes, _D_X, preferred_element_type=x.dtype,
                                            implementation="mosaic")
        d_w = _tokamax().ragged_dot_general(x, g, group_sizes, _D_W, preferred_element_type=w.dtype,
                                            implementation="mosaic")
    return _like(d_x, x), _like(d_w, w), None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
