"""Tensor parallelism (Megatron style) through shardings, and the vocab-parallel cross-entropy.

The split itself is four lines of `mesh.rules.RULES`: 'heads', 'kv_heads' and 'mlp' over tp
make q/k/v/gate/up column-parallel (each device computes some heads / some MLP columns with no
communication) and o/down row-parallel (each device holds a partial sum of the output, which
XLA all-reduces: the two all-reduces per layer per pass that Megatron's `f`/`g` operators do by
hand). 'vocab' over tp makes the embedding and the output layer vocab-parallel.

What needs care is the loss: the logits of a [tokens, vocab] output layer are split over the
vocabulary, and a naive `log_softmax` + gather would all-gather them onto every device. The
cross-entropy below only ever reduces over the vocabulary dimension (max, sum of exps, and the
target logit picked with a mask), so each device keeps its slice of the logits and XLA exchanges
[tokens]-sized partial results instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mesh.rules import constrain


def vocab_parallel_cross_entropy(hidden: jax.Array, kernel: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and token count.

    hidden: [N, D] final hidden states; kernel: [D, V] output layer (vocab split over tp);
    labels: [N] int. Logits and softmax statistics are fp32 whatever the compute dtype.
    """
    logits = jnp.einsum("nd,dv->nv", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
    logits = constrain(logits, ("tokens", "vocab"))
    # logsumexp over a split axis: a max and a sum, each reduced across tp as [N]-sized partials.
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[:, 0]
    # The target logit without a gather across shards: each device contributes the entry it owns.
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    target = jnp.sum(jnp.where(vocab_ids == labels[:, None], logits, 0.0), axis=-1)
    return jnp.sum(lse - target), jnp.asarray(labels.size, jnp.float32)
