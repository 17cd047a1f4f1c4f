"""Weight gradients taken out of the backward, for zero-bubble pipelines' W items.

A zero-bubble schedule (`pjax/parallel/pipeline_zero_bubble.py`) splits a stage's backward
in two: B, the input gradient, which the previous stage waits for, and W, the weight gradients,
which it runs later. Nearly all of W's work is the projections' dW = x^T g, where x is a
projection's input and g the cotangent of its output; B computes every g on its way to the
input gradient. So B must hand W each (x, g) and skip the dW products itself.

`tapped_projection(x, ws, tap)` does that through autodiff: it is the layer's projection, with
one more input, the *tap*, that its output does not depend on. Its backward returns the input
gradient, zeros for the weights, and (x, g) as the tap's "cotangent". Differentiating a stage
with respect to its input and a zero tap per projection (`layer_taps`) is then B: no dW product
is computed, and the taps' cotangents come out stacked per layer, through the layer scan and
remat alike. W (`tap_weight_grads`) multiplies them out. The other weights (the
norms' scales) are small and keep their gradients in B.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from models.config import LlamaConfig
from models.projection import input_grad, plain_projection, weight_grads

Tap = tuple[jax.Array, tuple[jax.Array, ...]]  # (like the input x [N, D_in], like each output [N, F_i])
SITES = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "gate_up": ("w_gate", "w_up"), "down": ("w_down",)}


@jax.custom_vjp
def tapped_projection(x: jax.Array, ws: Sequence[jax.Array], tap: Tap) -> tuple[jax.Array, ...]:
    """`plain_projection(x, ws)`; its backward leaves the weights' gradients to the tap (see above)."""
    del tap
    return plain_projection(x, ws)


def _fwd(x, ws, tap):
    del tap
    return plain_projection(x, ws), (x, ws)


def _bwd(res, gs):
    x, ws = res
    return input_grad(x, gs, ws), type(ws)(jnp.zeros_like(w) for w in ws), (x, tuple(gs))


tapped_projection.defvjp(_fwd, _bwd)


def layer_taps(cfg: LlamaConfig, layers: int, tokens: int, dtype: Any) -> dict[str, Tap]:
    """Zero taps for `layers` stacked layers of `tokens` tokens: per site, [layers, tokens, width]."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    widths = {"qkv": (d, (q, kv, kv)), "o": (q, (d,)), "gate_up": (d, (f, f)), "down": (f, (d,))}
    z = lambda w: jnp.zeros((layers, tokens, w), dtype)
    return {site: (z(x), tuple(z(w) for w in outs)) for site, (x, outs) in widths.items()}


def tap_weight_grads(taps: dict[str, Tap] | list[dict[str, Tap]], w: Any) -> dict[str, jax.Array]:
    """W: the projections' fp32 gradients from the taps' cotangents, shaped like the stacked
    layer weights `w` ([layers, ...] each); the other weights are not in the result. `taps` is
    stacked per layer, or (unrolled layers) a list of one layer's taps each."""
    f32 = lambda gs: [jnp.zeros((), jnp.float32)] * len(gs)  # weight_grads casts each dW to its w's dtype
    out = {}
    for site, names in SITES.items():
        if isinstance(taps, list):
            per_layer = [weight_grads(t[site][0], t[site][1], f32(t[site][1])) for t in taps]
            dws = [jnp.stack(d) for d in zip(*per_layer)]
        else:
            x, gs = taps[site]
            dws = jax.vmap(lambda x, gs: weight_grads(x, gs, f32(gs)))(x, gs)
        out.update({n: dw.reshape(w[n].shape) for n, dw in zip(names, dws)})
    return out
