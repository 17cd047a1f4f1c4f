"""Data parallelism and ZeRO: where parameters, gradients and optimizer state live over `dp`.

Nothing here communicates by hand. The batch is split over `dp` (the 'batch' rule), and XLA's
partitioner turns the sharding annotations below into the collectives:

* zero=0 -- plain DP. Parameters and Adam moments are replicated over dp; the gradient is
  all-reduced once per step.
* zero=1 -- ZeRO-1. Adam moments are split over dp (each parameter's 'embed' dim), so each
  replica updates only its slice; the gradient is reduce-scattered to that slice and the new
  parameters are all-gathered. Optimizer memory / dp.

Once per step, not once per micro-batch: left to itself, XLA reduces each micro-batch's
gradient as soon as it is computed (the parameters are replicated, so their gradient "must" be
too), which multiplies DP traffic by train.grad_accum. `reduce_once` makes dp manual for the
step (`shard_map` over dp only, tp/cp stay automatic inside), lets each replica accumulate its
own partial gradient, and reduces once at the end: `psum` for zero=0, `psum_scatter` (a real
reduce-scatter) to the moment slices for zero=1. This is what PyTorch DDP's `no_sync` does for
gradient accumulation.
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

from jax import lax

from mesh.mesh import CP, DP, PP
from mesh.rules import logical_to_spec, param_rules
from models import llama
from models.config import LlamaConfig

_is_names = lambda x: isinstance(x, tuple)  # leaves of the logical-axes tree are name tuples


def _shardings(mesh: Mesh, cfg: LlamaConfig, zero_sharded: bool) -> Any:
    """Every parameter's NamedSharding under the rules table. MoE expert weights are split over dp
    by their 'experts' dimension already (expert parallelism), so ZeRO leaves them as they are."""
    pipelined = mesh.shape[PP] > 1
    rules, expert_rules = param_rules(zero_sharded, pipelined), param_rules(False, pipelined)
    return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, expert_rules if "experts" in names
                                                                          else rules)),
                        llama.param_logical_axes(cfg), is_leaf=_is_names)


def param_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """NamedShardings for the parameters: split over dp only under ZeRO-3 (FSDP); with pp > 1 the
    stacked layers are split over pp (each pipeline stage holds its own)."""
    return _shardings(mesh, cfg, zero_sharded=zero >= 3)


def grad_shardings(mesh: Mesh, cfg: LlamaConfig, zero: int) -> Any:
    """Where gradients live: like the optimizer state, so ZeRO-1/3 reduce-scatter them."""
    return _shardings(mesh, cfg, zero_sharded=zero >= 1)


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


def can_reduce_once(mesh: Any, zero: int, cfg: LlamaConfig | None = None) -> bool:
    """Whether this step accumulates per dp replica and reduces once.

    Needs replicated parameters (zero < 3) and no pipeline (which reduces its own gradients).
    Not with cp > 1 either: ring attention's shard_map over cp nested in this one over dp is
    rejected by the Shardy partitioner ("manual axis cp after free axis dp"), so context-parallel
    layouts keep XLA's per-micro-batch reduction for now. Nor for MoE models yet: their layers
    exchange tokens over dp themselves, and their load-balancing loss needs the statistics of the
    whole batch, which this per-replica accumulation would have to sum first.
    """
    shape = {} if mesh.empty else dict(mesh.shape)
    moe = cfg is not None and cfg.num_local_experts > 0  # MoE layers are their own shard_map over dp (EP)
    return shape.get(DP, 1) > 1 and zero < 3 and shape.get(PP, 1) == 1 and shape.get(CP, 1) == 1 and not moe


def reduce_once(accumulate: Any, params: Any, batch: Any, cfg: LlamaConfig, zero: int) -> tuple[jax.Array, Any]:
    """Mean loss and gradients with one dp reduction per step.

    `accumulate(params, batch) -> (loss_sum, token_count, grad_sum)` runs on each replica's rows.
    """
    embed_dim = jax.tree.map(lambda names: names.index("embed"), llama.param_logical_axes(cfg), is_leaf=_is_names)

    def grad_spec(dim):  # where a reduced gradient lives over dp: whole (zero 0) or its embed slice (zero 1)
        return P() if zero == 0 else P(*([None] * dim + [DP]))

    def body(params, batch):
        # A varying (per-replica) copy: its gradient stays a local partial sum until reduced below.
        params = jax.tree.map(lambda p: lax.pcast(p, DP, to="varying"), params)
        loss, count, grads = accumulate(params, batch)
        loss, count = lax.psum((loss, count), DP)
        if zero == 0:
            grads = lax.psum(grads, DP)
        else:
            grads = jax.tree.map(lambda g, d: lax.psum_scatter(g, DP, scatter_dimension=d, tiled=True), grads, embed_dim)
        return loss / count, jax.tree.map(lambda g: g / count, grads)

    specs = (P(), jax.tree.map(grad_spec, embed_dim))
    return jax.shard_map(body, in_specs=(P(), P(None, DP)), out_specs=specs, axis_names={DP})(params, batch)
