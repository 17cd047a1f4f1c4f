"""Data parallelism and ZeRO: where parameters, gradients and optimizer state live over `dp`.

Nothing here communicates by hand. The batch is split over `dp` (the 'batch' rule), and XLA's
partitioner turns the sharding annotations below into the collectives:

* zero=0 -- plain DP. Parameters and Adam moments are replicated over dp; the gradient is
  all-reduced once per step.
* zero=1 -- ZeRO-1. Adam moments are split over dp (each parameter's 'embed' dim), so each
  replica updates only its slice; the gradient is reduce-scattered to that slice and the new
  parameters are all-gathered. Optimizer memory / dp.
* zero=3 -- ZeRO-3 / FSDP. Parameters are split like the moments; each layer's weights are
  all-gathered just before use (forward and backward) and gradients reduce-scattered. This only
  works if activations stay split over the batch -- the model pins them with `constrain`, or XLA
  would rather split the contracting dimension and all-reduce activations.
"""
from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.mesh import PP
from mesh.rules import logical_to_spec, param_rules
from models import llama
from models.config import LlamaConfig

_is_names = lambda x: isinstance(x, tuple)  # leaves of the logical-axes tree are name tuples


def param_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """NamedShardings for the parameters: split over dp only under ZeRO-3 (FSDP); with pp > 1 the
    stacked layers are split over pp (each pipeline stage holds its own)."""
    rules = param_rules(zero_sharded=zero >= 3, pipelined=mesh.shape[PP] > 1)
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules)),
                        llama.param_logical_axes(cfg), is_leaf=_is_names)


def grad_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """Where gradients live: like the optimizer state, so ZeRO-1/3 reduce-scatter them."""
    rules = param_rules(zero_sharded=zero >= 1, pipelined=mesh.shape[PP] > 1)
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules)),
                        llama.param_logical_axes(cfg), is_leaf=_is_names)


def opt_state_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int, optimizer: optax.GradientTransformation,
                        params_shape: Any) -> Any:
    """Shardings for every optimizer-state leaf: parameter-shaped leaves (Adam moments) follow
    `grad_shardings`, the rest (step counts) are replicated.

    `jax.eval_shape(optimizer.init, ...)` gives shapes but no shardings, so they are derived
    from the parameters' logical axes here (also what a checkpoint restore needs).
    """
    state_shape = jax.eval_shape(optimizer.init, params_shape)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, s: s, state_shape, grad_shardings(mesh, cfg, zero),
                                 transform_non_params=lambda _: replicated)
