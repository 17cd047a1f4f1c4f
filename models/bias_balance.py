"""Bias-based load balancing (DeepSeek-V3's "auxiliary-loss-free" balancing): each MoE layer adds a per-expert bias
to the router's scores to *select* experts, never to weight them, and after every step the bias moves by a fixed
rate against the load the layer saw: up for an expert under its even share, down for one over it.

The load a layer saw travels back as its bias' gradient (`load_tap`). So the layer scan, every pipeline schedule,
the micro-batches and the data-parallel reduction sum it like any other gradient, and the step reads each layer's
load from where its bias' gradient lands (`split_loads`); the optimizer never sees it (ARCHITECTURE.md,
"Bias balancing: the load rides the bias' gradient")."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

BIAS = "router_bias"  # the parameter: [layers, experts] under "layers"


@jax.custom_vjp
def load_tap(weights: jax.Array, bias: jax.Array, load: jax.Array) -> jax.Array:
    """`weights` unchanged; differentiated, `bias`' cotangent is `load` [E] (the cotangent of `weights`
    passes through). Tapped on the routing weights, which every loss reads, so the backward always runs."""
    del bias, load
    return weights


def _tap_fwd(weights, bias, load):
    return weights, (bias, load)


def _tap_bwd(saved, ct):
    bias, load = saved
    return ct, load.astype(bias.dtype), jnp.zeros_like(load)


load_tap.defvjp(_tap_fwd, _tap_bwd)


def tapped(weights: jax.Array, bias: jax.Array, load: jax.Array) -> jax.Array:
    """`load_tap`, with `bias` and `load` first cast to vary over the same manual axes: the cotangent is then a
    device's own count, and the cast's transpose sums the counts, as it sums any replicated weight's gradient."""
    axes = lambda a: set(jax.typeof(a).manual_axis_type.varying)  # noqa: E731
    both = axes(bias) | axes(load)
    bias, load = (lax.pcast(a, tuple(sorted(both - axes(a))), to="varying") if both - axes(a) else a
                  for a in (bias, load))
    return load_tap(weights, bias, load)


def split_loads(grads: Any) -> tuple[jax.Array | None, Any]:
    """(each layer's load [.., E] as its experts' shares of its assignments, or None without biases; `grads` with
    zeros where the loads were, so the norm, the clipping and the optimizer see no load). Shares, because a
    strategy may scale its gradients by the token count before or after the tap (a pipeline's loss is pre-scaled)."""
    layers = grads.get("layers", {}) if isinstance(grads, dict) else {}
    if BIAS not in layers:
        return None, grads
    loads = layers[BIAS]
    total = jnp.sum(loads, axis=-1, keepdims=True)
    return loads / jnp.where(total > 0, total, 1), {**grads, "layers": {**layers, BIAS: jnp.zeros_like(loads)}}


def moved(params: Any, before: Any, loads: jax.Array | None, rate: float) -> Any:
    """`params` with each layer's bias at its value `before` the step plus `rate` times the sign of (the mean
    load - the expert's load): DeepSeek-V3's update, outside the optimizer (no decay, no moments)."""
    if loads is None:
        return params
    bias = before["layers"][BIAS]
    step = rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)
    return {**params, "layers": {**params["layers"], BIAS: bias + step.astype(bias.dtype)}}
