"""Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022; `train.sequence_parallel`): between the
tensor-parallel regions the tokens are split over tp. Each op is a `custom_vjp` around a shard_map
(ARCHITECTURE.md, "Sequence parallelism by hand")."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import TP, current
from mesh.rules import auto_size, in_shard_groups, logical_to_spec, per_device
from models.projection import (PLAIN, Gemm, Quantized, cotangent, merge_over_tp, split_over_tp, weight_grads,
                               weight_products)

TOKENS, SP_TOKENS = logical_to_spec(("tokens",)), logical_to_spec(("sp_tokens",))


def active(enabled: bool) -> bool:
    """Sequence parallelism is on and tp splits something here."""
    return enabled and auto_size(current(), TP) > 1


def residual_axis(enabled: bool) -> str:
    """The logical name of the residual stream's token dimension."""
    return "sp_tokens" if active(enabled) else "tokens"


def _per_device(fn, in_specs, out_specs):
    return per_device(fn, in_specs, out_specs)


def gather(x: jax.Array) -> jax.Array:
    """[N, ...] split over (dp, cp, tp) -> split over (dp, cp): all-gather over tp (pure data movement)."""
    return _per_device(lambda a: lax.all_gather(a, TP, axis=0, tiled=True, to="invarying"), (SP_TOKENS,), TOKENS)(x)


def gather_transposed(x: jax.Array) -> jax.Array:
    """x^T gathered, [D, N]: a different op from the forward's gather, which XLA would otherwise merge
    with it and keep alive, undoing the memory saving."""
    return _per_device(lambda a: lax.all_gather(a.T, TP, axis=1, tiled=True, to="invarying"),
                       (SP_TOKENS,), P(None, TOKENS[0]))(x)


def reduce_scatter_product(gs: Sequence[jax.Array], ws: Sequence[jax.Array], dtype, gemm: Gemm = PLAIN
                           ) -> jax.Array:
    """sum_i g_i @ w_i^T reduce-scattered over tp along the tokens: a column-parallel input gradient."""
    def local(gs, ws):
        g = jnp.concatenate([g.astype(dtype) for g in gs], axis=-1)
        w = merge_over_tp([w.astype(dtype) for w in ws], 1)  # this device's blocks side by side
        d = gemm.input_grad(g, w, jnp.float32).astype(dtype)
        return lax.psum_scatter(d, TP, scatter_dimension=0, tiled=True)

    block = P(None, TP)  # a column-parallel weight's; a `Quantized` one's fp8 values alike, its scale whole
    specs = ([P(TOKENS[0], TP)] * len(gs), [Quantized(block, block, P()) if isinstance(w, Quantized) else block
                                            for w in ws])
    return _per_device(local, specs, SP_TOKENS)(list(gs), list(ws))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def column(x: jax.Array, ws: Sequence[jax.Array], out_dtype=None, gemm: Gemm = PLAIN) -> tuple[jax.Array, ...]:
    """x [N, D] (tokens over dp, cp, tp) gathered over tp, times each column-parallel w [D, F_i] (in `out_dtype`,
    the output layer's, or by `gemm`)."""
    full = gather(x)
    if out_dtype is not None:
        return tuple(jnp.matmul(full, w, preferred_element_type=out_dtype) for w in ws)
    if gemm.merged and len(ws) > 1:  # one GEMM, one scale for the weights (`Gemm.merged`)
        tp = auto_size(current(), TP)
        return split_over_tp(gemm.multiply(*gemm.prepare(full, merge_over_tp(ws, tp)), full.dtype),
                             [w.shape[-1] for w in ws], tp)
    return tuple(gemm.multiply(*gemm.prepare(full, w), full.dtype) for w in ws)


def _column_fwd(x, ws, out_dtype, gemm):
    return column(x, ws, out_dtype, gemm), (x, ws)


def _column_bwd(out_dtype, gemm, res, gs):
    x, ws = res
    gs = [g.astype(x.dtype) for g in gs]
    xt = gather_transposed(x)
    d_ws = tuple(cotangent(w, dw) for dw, w in zip(weight_products(xt, gs, gemm), ws))
    return reduce_scatter_product(gs, ws, x.dtype, gemm), type(ws)(d_ws)


column.defvjp(_column_fwd, _column_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def row(x: jax.Array, w: jax.Array, gemm: Gemm = PLAIN) -> jax.Array:
    """x [N, F] times the row-parallel w [F, D], reduce-scattered over tp along the tokens."""
    def local(a, b, scale):
        return lax.psum_scatter(gemm.multiply(a, b, scale, x.dtype), TP, scatter_dimension=0, tiled=True)

    # The operands are prepared (fp8: quantized) outside the shard_map: inside, a scan's linearization would
    # hoist w's quantization out as residuals of the nested shard_map, which jax 0.10.2 shards wrongly.
    return _per_device(local, (P(TOKENS[0], TP), P(TP, None), P()), SP_TOKENS)(*gemm.prepare(x, w))


def _row_fwd(x, w, gemm):
    return row(x, w, gemm), (x, w)


def _row_bwd(gemm, res, g):
    x, w = res
    full = gather(g.astype(x.dtype))
    (d_w,) = weight_grads(x, [full], [w], gemm)
    return gemm.input_grad(full, w).astype(x.dtype), d_w


row.defvjp(_row_fwd, _row_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """The vocab-parallel embedding lookup of `ids` [N] in `dtype`, reduce-scattered over tp."""
    def local(table, ids):
        v = table.shape[0]
        rows = ids - lax.axis_index(TP) * v
        hit = (rows >= 0) & (rows < v)
        x = jnp.where(hit[:, None], jnp.take(table, jnp.clip(rows, 0, v - 1), axis=0), 0).astype(dtype)
        return lax.psum_scatter(x, TP, scatter_dimension=0, tiled=True)

    return _per_device(local, (P(TP, None), TOKENS), SP_TOKENS)(table, ids)


def _lookup_fwd(table, ids, dtype):
    return lookup(table, ids, dtype), (table, ids)


def _lookup_bwd(dtype, res, g):
    table, ids = res
    _, take_vjp = jax.vjp(lambda t: jnp.take(t, ids, axis=0).astype(dtype), table)
    (d_table,) = take_vjp(in_shard_groups(gather(g)))  # HSDP: each group's rows into its own shards
    return d_table, None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


def check_run(run) -> None:
    """With train.sequence_parallel and tp > 1: the tokens split over tp."""
    mc, tc = run.mesh, run.train
    if not (tc.sequence_parallel and mc.tp > 1):
        return
    tokens = tc.batch_size // tc.grad_accum // mc.dp * (tc.seq_len // mc.cp)
    if tokens % mc.tp:
        raise ConfigError(f"train.sequence_parallel splits a device's {tokens} tokens per micro-batch over "
                          f"mesh.tp={mc.tp}, which does not divide them; change train.seq_len, batch_size or "
                          f"grad_accum, or set it to false.")
    if tc.loss_chunk % mc.tp:
        raise ConfigError(f"train.loss_chunk={tc.loss_chunk} with train.sequence_parallel takes loss_chunk / mesh.tp "
                          f"tokens from each tp part of the tokens; choose a multiple of mesh.tp={mc.tp}.")
