"""Greedy continuation of a prompt on the mesh (`pjax.eval --generate`).

No KV cache: each new token re-runs the whole fixed-length sequence, so one compiled function serves every
step with the training model's code; causal attention hides the not-yet-written tail from the position read."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import CP, DATA, data_size
from mesh.rules import unflatten_tokens
from models import llama
from models.attention import select_attention
from models.config import LlamaConfig
from models.precision import Precision
from pjax.spec import StepSpec

Params = dict[str, Any]


def put_rows(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array onto the mesh, each device's slice cut from it: every process holds the whole array."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


@functools.partial(jax.jit, static_argnames="spec")
def _greedy(params: Params, tokens: jax.Array, start: jax.Array, stop: jax.Array, *, spec: StepSpec) -> jax.Array:
    """Fill tokens[:, start:stop] greedily, one whole-sequence forward per token."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cfg = spec.cfg
    kernel = llama.output_kernel(params, cfg)

    def body(i, toks):
        hidden = spec.hidden(params, toks, positions)
        last = jax.lax.dynamic_index_in_dim(unflatten_tokens(hidden, b, t), i - 1, axis=1, keepdims=False)
        logits = jnp.einsum("bd,dv->bv", last, kernel.astype(last.dtype), preferred_element_type=jnp.float32)
        nxt = jnp.argmax(llama.mask_padded_vocab(logits, cfg.vocab_size), axis=-1).astype(toks.dtype)
        return jax.lax.dynamic_update_index_in_dim(toks, nxt, i, axis=1)

    return jax.lax.fori_loop(start, stop, body, tokens)


def generate(params: Params, cfg: LlamaConfig, prompt: Sequence[int], mesh: Mesh, *, max_new_tokens: int,
             precision: Precision = Precision(), scan: bool = True, attention: str = "auto") -> list[int]:
    """Greedy continuation of `prompt` (token ids): up to max_new_tokens, within max_position_embeddings."""
    if not prompt:
        raise ConfigError("--generate got a prompt with no tokens; pass some text to continue.")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} is invalid; use an integer >= 1.")
    limit = cfg.max_position_embeddings
    if len(prompt) >= limit:
        raise ConfigError(f"the prompt has {len(prompt)} tokens, at least the model's max_position_embeddings="
                          f"{limit}; shorten it.")
    stop = min(len(prompt) + max_new_tokens, limit)
    dp, cp = data_size(mesh), mesh.shape[CP]
    # One row per dp replica (the batch rule splits rows over dp) and a length cp divides; row 0 is read.
    length = -(-stop // cp) * cp
    tokens = np.zeros((dp, length), np.int32)
    tokens[:, :len(prompt)] = prompt
    with jax.set_mesh(mesh):
        out = _greedy(params, put_rows(tokens, NamedSharding(mesh, P(DATA, CP))), jnp.int32(len(prompt)),
                      jnp.int32(stop), spec=StepSpec(cfg, precision, select_attention(attention), scan=scan))
    return np.asarray(jax.device_get(out))[0, len(prompt):stop].tolist()
