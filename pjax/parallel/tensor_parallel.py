"""Tensor parallelism (Megatron style) through shardings, and the vocab-parallel cross-entropy.

The split itself is four lines of `mesh.rules.RULES`: 'heads', 'kv_heads' and 'mlp' over tp
make q/k/v/gate/up column-parallel (each device computes some heads / some MLP columns with no
communication) and o/down row-parallel (each device holds a partial sum of the output, which
XLA all-reduces: the two all-reduces per layer per pass that Megatron's `f`/`g` operators do by
hand). 'vocab' over tp makes the embedding and the output layer vocab-parallel. In the backward,
q/k/v (and gate/up) share an input whose gradient is a partial sum over all three: it is taken
from one dot over the joined operands (`models/projection.py`), so XLA all-reduces it once.

What needs care is the loss: the logits of a [tokens, vocab] output layer are split over the
vocabulary, and a naive `log_softmax` + gather would all-gather them onto every device. The
cross-entropy below only ever reduces over the vocabulary dimension (max, sum of exps, and the
target logit picked with a mask), so each device keeps its slice of the logits and XLA exchanges
[tokens]-sized partial results instead.

`chunk` fuses the output layer with the loss over blocks of tokens (a `lax.scan` whose
`custom_vjp` computes each block's gradients as it goes): the [tokens, vocab] logits never exist
whole, only [chunk, vocab] at a time, which is what large vocabularies need (Llama 3's 128k
logits of an 8k-token micro-batch are 4 GB in fp32). It is off by default: at small
vocabularies the blocks cost more step time than the logits they save (benchmarks/README.md).
Where the tokens are split over dp/cp automatically (ZeRO-3, MoE), each block takes `chunk`
tokens of every device's share, and the output layer's gradient is summed per share through the
blocks and reduced once after them: summed over the whole block, XLA would reduce it over the
token split once per block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mesh.errors import ConfigError
from mesh.mesh import CP, DP
from mesh.rules import auto_size, constrain
from models import sequence_parallel as seqpar
from models.llama import mask_padded_vocab


def vocab_parallel_cross_entropy(hidden: jax.Array, kernel: jax.Array, labels: jax.Array,
                                 chunk: int = 0, vocab_size: int | None = None,
                                 sequence_parallel: bool = False) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and token count.

    hidden: [N, D] final hidden states; kernel: [D, V] output layer (vocab split over tp);
    labels: [N] int. Logits and softmax statistics are fp32 whatever the compute dtype.
    chunk: tokens per block of the fused output layer + loss (0: all N at once; see the module doc).
    vocab_size: the real vocabulary when the kernel's V is padded: the padded logits are masked out.
    sequence_parallel: hidden's tokens are split over tp too; the output layer gathers them
    (`models.sequence_parallel.column`). With `chunk` the fused blocks take the hidden states as
    they are (right, but XLA all-reduces each block's input gradient over tp: `pjax.step` refuses
    the combination).
    """
    vocab_size = kernel.shape[1] if vocab_size is None else vocab_size
    count = jnp.asarray(labels.size, jnp.float32)
    kernel = kernel.astype(hidden.dtype)
    n = hidden.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    sp = seqpar.active(sequence_parallel)
    shares = auto_size(mesh, DP) * auto_size(mesh, CP)  # the devices the tokens are split over here
    if 0 < chunk < n // shares:
        if (n // shares) % chunk:
            raise ConfigError(f"train.loss_chunk={chunk} does not divide the {n // shares} tokens of a device's "
                              f"micro-batch; choose a divisor of {n // shares} (or 0 to turn chunking off).")
        return _fused(hidden, kernel, labels, chunk, vocab_size, shares), count
    return _loss_and_dlogits(hidden, kernel, labels, vocab_size, with_grad=False, sp=sp)[0], count


def _loss_and_dlogits(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, vocab_size: int,
                      with_grad: bool, sp: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Summed loss of [N, D] hidden states and, if `with_grad`, d(loss)/d(logits) [N, V] in fp32."""
    logits = seqpar.column(hidden, [kernel], jnp.float32)[0] if sp else output_logits(hidden, kernel)
    logits = constrain(logits, ("tokens", "vocab"))
    logits = mask_padded_vocab(logits, vocab_size)  # -inf: exp gives exactly 0, so nothing else changes
    # logsumexp over a split axis: a max and a sum, each reduced across tp as [N]-sized partials.
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - m)
    total = jnp.sum(e, axis=-1)
    lse = jnp.log(total) + m[:, 0]
    # The target logit without a gather across shards: each device contributes the entry it owns.
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == labels[:, None]
    target = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    loss = jnp.sum(lse - target)
    return loss, (e / total[:, None] - hit.astype(jnp.float32) if with_grad else None)


def output_logits(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """fp32 logits [N, V] of hidden [N, D] and kernel [D, V] (same dtype), with a backward tuned per backend.

    With 16-bit operands the backward's two matmuls take d(logits) in that dtype too. Plain
    autodiff would hand them the fp32 cotangent, and on GPU the [N, V] x [V, D] and [D, N] x [N, V]
    products then run as fp32 (tf32) GEMMs: 7% of a SmolLM-360M step on an H100. On XLA:CPU the
    kernel's gradient is taken from a materialised hidden^T, as `models.projection` does for the
    layers (~1% of the picotron-cpu step). Elsewhere fp32 is plain autodiff.
    """
    if hidden.dtype == jnp.float32 and jax.default_backend() != "cpu":
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
    if jax.default_backend() == "cpu":
        ht = jax.lax.optimization_barrier(hidden.T)  # [D, N]: XLA:CPU's dots prefer it to contracting [N, D] over N
        d_kernel = jnp.matmul(ht, g, preferred_element_type=jnp.float32)
    else:
        d_kernel = jnp.einsum("nd,nv->dv", hidden, g, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, chunk: int, vocab_size: int,
           shares: int) -> jax.Array:
    return _fused_fwd(hidden, kernel, labels, chunk, vocab_size, shares)[0]


def _fused_fwd(hidden, kernel, labels, chunk, vocab_size, shares):
    """The loss and both gradients, block by block: the loss is the end of the graph, so its
    gradients can be formed in the forward pass and only [N, D] + [D, V] kept for the backward.
    Block i is tokens [i*chunk, (i+1)*chunk) of each of the `shares` devices' [N/shares] tokens."""
    def block(carry, xs):
        loss, d_kernel = carry
        h, y = xs                                            # [shares, chunk, D], [shares, chunk]
        block_loss, d_logits = _loss_and_dlogits(h.reshape(-1, d), kernel, y.reshape(-1), vocab_size, with_grad=True)
        d_logits = d_logits.astype(h.dtype).reshape(shares, chunk, -1)
        d_h = jnp.einsum("snv,dv->snd", d_logits, kernel, preferred_element_type=jnp.float32)
        d_kernel = d_kernel + jnp.einsum("snd,snv->sdv", h, d_logits, preferred_element_type=jnp.float32)
        return (loss + block_loss, constrain(d_kernel, ("tokens", None, "vocab"))), d_h.astype(h.dtype)

    n, d = hidden.shape
    blocks = n // (shares * chunk)
    cut = lambda a: jnp.swapaxes(a.reshape(shares, blocks, chunk, *a.shape[1:]), 0, 1)  # [blocks, shares, chunk, ...]
    # Zeros typed like what the blocks add (inside a shard_map: varying wherever hidden or kernel is).
    like = lambda shape: jnp.zeros_like(hidden, jnp.float32, shape=shape) + jnp.zeros_like(kernel, jnp.float32,
                                                                                              shape=shape)
    zeros = (like(()), constrain(like((shares, *kernel.shape)), ("tokens", None, "vocab")))
    (loss, d_kernel), d_hidden = jax.lax.scan(block, zeros, (cut(hidden), cut(labels)))
    d_hidden = jnp.swapaxes(d_hidden, 0, 1).reshape(n, d)
    return loss, (d_hidden, jnp.sum(d_kernel, axis=0).astype(kernel.dtype))  # one reduction over the shares


def _fused_bwd(chunk, vocab_size, shares, res, g):
    d_hidden, d_kernel = res
    return (g * d_hidden).astype(d_hidden.dtype), (g * d_kernel).astype(d_kernel.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
