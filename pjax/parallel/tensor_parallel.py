"""Tensor parallelism (Megatron style) through shardings (`mesh.rules`), and the vocab-parallel cross-entropy: only
reductions over the vocabulary, so each device keeps its slice of the logits (ARCHITECTURE.md, "Vocab-parallel
cross-entropy by reductions only"). `chunk` fuses the output layer with the loss over blocks of tokens, so [tokens,
vocab] logits never exist whole; with tokens split over dp/cp automatically, the kernel's gradient is summed per share
and reduced once after the blocks (ARCHITECTURE.md, "Fused, chunked output layer + loss")."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mesh.backend import target_backend
from mesh.errors import ConfigError
from mesh.mesh import CP, TP, current
from mesh.rules import auto_rows, auto_size, constrain
from models import sequence_parallel as seqpar
from models.llama import mask_padded_vocab


def vocab_parallel_cross_entropy(hidden: jax.Array, kernel: jax.Array, labels: jax.Array,
                                 chunk: int = 0, vocab_size: int | None = None,
                                 sequence_parallel: bool = False, weights: jax.Array | None = None
                                 ) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy in fp32, token count) of hidden [N, D], kernel [D, V], labels [N]; `vocab_size` masks a
    padded V. `weights` [N] (evaluation's: 0 on padding) weigh each token's loss, the count being their sum; the
    training step passes none, and they do not combine with `chunk`."""
    vocab_size = kernel.shape[1] if vocab_size is None else vocab_size
    if weights is not None:
        if chunk:
            raise ValueError("vocab_parallel_cross_entropy: weights apply to the unchunked loss only (chunk=0)")
        return _loss_and_dlogits(hidden, kernel, labels, vocab_size, with_grad=False, weights=weights)[0], \
            jnp.sum(weights.astype(jnp.float32))
    count = jnp.asarray(labels.size, jnp.float32)
    kernel = kernel.astype(hidden.dtype)
    n = hidden.shape[0]
    mesh = current()
    sp = seqpar.active(sequence_parallel)
    shares = auto_rows(mesh) * auto_size(mesh, CP)
    if 0 < chunk < n // shares:
        if (n // shares) % chunk:
            raise ConfigError(f"train.loss_chunk={chunk} does not divide the {n // shares} tokens of a device's "
                              f"micro-batch; choose a divisor of {n // shares} (or 0 to turn chunking off).")
        parts = auto_size(mesh, TP) if sp else 1  # sequence_parallel.check_run: chunk splits over tp
        return _fused(hidden, kernel, labels, chunk, vocab_size, shares, parts), count
    return _loss_and_dlogits(hidden, kernel, labels, vocab_size, with_grad=False, sp=sp)[0], count


def _loss_and_dlogits(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, vocab_size: int,
                      with_grad: bool, sp: bool = False, weights: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array | None]:
    """Summed loss of [N, D] hidden states and, if `with_grad`, d(loss)/d(logits) [N, V] in fp32; `weights` [N]
    weigh the tokens' losses (none: all 1)."""
    logits = seqpar.column(hidden, [kernel], jnp.float32)[0] if sp else output_logits(hidden, kernel)
    logits = constrain(logits, ("tokens", "vocab"))
    logits = mask_padded_vocab(logits, vocab_size)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - m)
    total = jnp.sum(e, axis=-1)
    lse = jnp.log(total) + m[:, 0]
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == labels[:, None]
    target = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    if weights is None:
        loss = jnp.sum(lse - target)
        return loss, (e / total[:, None] - hit.astype(jnp.float32) if with_grad else None)
    # where, not a multiply: a position of weight 0 (padding) is never mixed in, even if its loss is not finite.
    weights = jnp.where(weights > 0, weights.astype(jnp.float32), 0.0)
    loss = jnp.sum(jnp.where(weights > 0, (lse - target) * weights, 0.0))
    return loss, ((e / total[:, None] - hit.astype(jnp.float32)) * weights[:, None] if with_grad else None)


def output_logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """fp32 logits [N, V], backward in the operands' dtype (ARCHITECTURE.md, "The output layer's backward in the compute
    dtype"); on XLA:CPU, d(kernel) from a materialised hidden^T."""
    if hidden.dtype == jnp.float32 and target_backend() != "cpu":
        return jnp.einsum("nd,dv->nv", hidden, kernel, preferred_element_type=jnp.float32)
    return _logits(hidden, kernel)


@jax.custom_vjp
def _logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum("nd,dv->nv", hidden, kernel, preferred_element_type=jnp.float32)


def _logits_fwd(hidden, kernel):
    return _logits(hidden, kernel), (hidden, kernel)


def _logits_bwd(res, g):
    hidden, kernel = res
    g = g.astype(hidden.dtype)
    d_hidden = jnp.einsum("nv,dv->nd", g, kernel, preferred_element_type=jnp.float32)
    if target_backend() == "cpu":
        ht = jax.lax.optimization_barrier(hidden.T)
        d_kernel = jnp.matmul(ht, g, preferred_element_type=jnp.float32)
    else:
        d_kernel = jnp.einsum("nd,nv->dv", hidden, g, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, chunk: int, vocab_size: int,
           shares: int, parts: int) -> jax.Array:
    return _fused_fwd(hidden, kernel, labels, chunk, vocab_size, shares, parts)[0]


def _fused_fwd(hidden, kernel, labels, chunk, vocab_size, shares, parts):
    """The loss and both gradients block by block. A block holds chunk / parts tokens of each of a share's `parts`
    (1, or tp under sequence parallelism: the tokens' split over tp), so each block's logits gather its tokens over
    tp and its input gradient leaves by reduce-scatter, as the unchunked output layer's do."""
    sp = parts > 1

    def block(carry, xs):
        loss, d_kernel = carry
        h, y = xs
        h = constrain(h.reshape(-1, d), ("tokens", None))  # under SP: gathered over tp once, for both products
        block_loss, d_logits = _loss_and_dlogits(h, kernel, y.reshape(-1), vocab_size, with_grad=True)
        if sp:  # explicitly: XLA:CPU would all-reduce the block's input gradient and slice it
            d_h = seqpar.reduce_scatter_product([d_logits], [kernel], h.dtype).reshape(shares, parts, step, d)
            d_h = constrain(d_h, ("tokens", "sp_part", None, None))
        d_logits = d_logits.astype(h.dtype).reshape(shares, parts * step, -1)
        if not sp:
            d_h = jnp.einsum("snv,dv->snd", d_logits, kernel, preferred_element_type=jnp.float32).reshape(
                shares, parts, step, d)
        d_kernel = d_kernel + jnp.einsum("snd,snv->sdv", h.reshape(shares, parts * step, d), d_logits,
                                         preferred_element_type=jnp.float32)
        return (loss + block_loss, constrain(d_kernel, ("tokens", None, "vocab"))), d_h.astype(hidden.dtype)

    n, d = hidden.shape
    blocks, step = n // (shares * chunk), chunk // parts
    # [n, ...] -> [blocks, shares, parts, step, ...]: block i takes tokens [i*step, (i+1)*step) of every part.
    cut = lambda a: jnp.moveaxis(a.reshape(shares, parts, blocks, step, *a.shape[1:]), 2, 0)
    # Zeros typed like what the blocks add (inside a shard_map: varying wherever hidden or kernel is).
    like = lambda shape: jnp.zeros_like(hidden, jnp.float32, shape=shape) + jnp.zeros_like(kernel, jnp.float32,
                                                                                              shape=shape)
    zeros = (like(()), constrain(like((shares, *kernel.shape)), ("tokens", None, "vocab")))
    (loss, d_kernel), d_hidden = jax.lax.scan(block, zeros, (cut(hidden), cut(labels)))
    d_hidden = jnp.moveaxis(d_hidden, 0, 2).reshape(n, d)
    return loss, (d_hidden, jnp.sum(d_kernel, axis=0).astype(kernel.dtype))


def _fused_bwd(chunk, vocab_size, shares, parts, res, g):
    d_hidden, d_kernel = res
    return (g * d_hidden).astype(d_hidden.dtype), (g * d_kernel).astype(d_kernel.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
