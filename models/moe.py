"""Mixture of Experts: top-k routing, three ways to run the experts, and expert parallelism over dp.

A sparse MLP holds E experts, each a SwiGLU of its own, and a router. For tokens x [N, D]:
    logits = x @ w_router                [N, E] (fp32)
    probs  = softmax(logits)             top-k per token -> experts [N, k], their probs renormalised
                                         to sum to 1 (Mixtral's rule) -> weights [N, k]
    y[n]   = sum_j weights[n, j] * expert_{experts[n, j]}(x[n])
Each (token, chosen expert) pair is an *assignment*: N*k of them.

Three ways to compute y, equal up to float rounding when nothing is dropped:
* `dense`: every expert on every token, combined with an [N, E] weight matrix (zero off the top-k).
  E/k times the work; the reference the tests compare the others against.
* `dropless`: the assignments sorted by expert, the experts run as grouped matmuls over contiguous
  groups (`jax.lax.ragged_dot`), then unsorted. No assignment is dropped. (XLA:CPU lowers
  `ragged_dot` as a masked dense product: right, not faster. GPUs and TPUs run grouped GEMMs.)
* `capacity`: each expert takes at most C assignments (GShard, Switch): a token's first choice is
  queued before any token's second choice, and within a choice in token order; assignments past C
  are dropped (weight 0). A token whose every choice is dropped gets 0 from the layer, so it
  passes through the layer's residual connection unchanged. The buffer is [E, C, D] whatever the
  routing did: fixed shapes, which is what an all-to-all needs.

Expert parallelism, without a fifth mesh axis: the tokens are already split over dp, so the
experts are split over dp too (logical axis 'experts' -> dp, as GShard and DeepSpeed-MoE do).
Each device routes its own tokens into an [E, C, D] buffer, and one `all_to_all` over dp sends
row block j (the experts device j owns) to device j, which receives [E/dp, dp*C, D]: every
device's tokens for its own experts. It runs them, and a second `all_to_all` sends the results
back to where the tokens live. Two all-to-alls per layer and pass, each moving E*C*D values per
device; dropless (and dense) under EP use the capacity that can never overflow, C = tokens per
device (a token picks an expert at most once): exact, at E/k times the buffer of capacity factor 1.

Router statistics are returned as sums over the layer's tokens (per device, summed over dp under
EP), so they add across devices, micro-batches and layers: `aux_losses` turns them into the
load-balancing loss of Switch/Mixtral (HF's `load_balancing_loss_func`, layers concatenated) and
the router z-loss of ST-MoE.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.errors import ConfigError
from mesh.mesh import CP, DP, PP
from mesh.rules import logical_to_spec

ROUTINGS = ("dropless", "capacity", "dense")
ROUTER_METRICS = ("aux_loss", "z_loss", "dropped_fraction", "load_min", "load_max")  # `aux_losses`' keys
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """How MoE layers run (the `moe` config section); the experts themselves are model keys."""

    routing: str = "dropless"      # dropless | capacity | dense (the reference: every expert on every token)
    capacity_factor: float = 1.25  # capacity mode: each expert takes ceil(factor * tokens * k / E) assignments

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"moe.routing={self.routing!r} is invalid; choose one of {', '.join(ROUTINGS)}.")
        if not isinstance(self.capacity_factor, (int, float)) or not self.capacity_factor > 0:
            raise ConfigError(f"moe.capacity_factor={self.capacity_factor!r} is invalid; use a number > 0.")


class RouterStats(NamedTuple):
    """Sums over tokens, so they add across devices and micro-batches (see `aux_losses`)."""

    tokens: jax.Array    # [] tokens routed
    assigned: jax.Array  # [E] assignments each expert received (before any drop)
    prob: jax.Array      # [E] router probabilities summed over tokens
    z: jax.Array         # [] sum over tokens of logsumexp(logits)^2
    dropped: jax.Array   # [] assignments dropped for capacity


def route(x: jax.Array, w_router: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, RouterStats]:
    """(weights [N, k] fp32, experts [N, k] int32, stats) for tokens x [N, D]."""
    logits = jnp.einsum("nd,de->ne", x, w_router.astype(x.dtype), preferred_element_type=F32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = lax.top_k(probs, top_k)
    weights = top / jnp.sum(top, axis=-1, keepdims=True)
    num_experts = w_router.shape[-1]
    stats = RouterStats(tokens=jnp.asarray(x.shape[0], F32),
                        assigned=jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=F32), axis=(0, 1)),
                        prob=jnp.sum(probs, axis=0),
                        z=jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
                        dropped=jnp.zeros((), F32))
    return weights, experts.astype(jnp.int32), stats


def aux_losses(stats: RouterStats, layers: int = 1) -> dict[str, jax.Array]:
    """{'aux_loss', 'z_loss', 'dropped_fraction', 'load_min', 'load_max'} from stats summed over
    `layers` MoE layers (each routing the same tokens).

    aux_loss = E * sum_e f_e * P_e, f_e the fraction of assignments-per-token going to expert e and
    P_e its mean router probability, both averaged over every layer's tokens (HF's Mixtral form: k,
    the experts per token, when routing is uniform). load_min/max: the least and most loaded
    expert's share of assignments relative to a uniform share (1.0 = balanced)."""
    tokens = stats.tokens / layers  # per layer
    num_experts = stats.assigned.shape[-1]
    f = stats.assigned / (layers * tokens)
    p = stats.prob / (layers * tokens)
    share = stats.assigned / jnp.sum(stats.assigned) * num_experts
    return {"aux_loss": num_experts * jnp.sum(f * p), "z_loss": stats.z / (layers * tokens),
            "dropped_fraction": stats.dropped / jnp.sum(stats.assigned),
            "load_min": jnp.min(share), "load_max": jnp.max(share)}


def router_loss(stats: RouterStats, count: jax.Array, cfg: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """What an MoE model adds to a micro-batch's summed cross-entropy over `count` tokens:
    count * (router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss), so that dividing by
    the count gives the mean cross-entropy plus each coefficient times its router loss; and the
    router metrics (`aux_losses` of `stats`, summed over the model's cfg.num_hidden_layers)."""
    metrics = aux_losses(stats, cfg.num_hidden_layers)
    return count * (cfg.router_aux_loss_coef * metrics["aux_loss"] + cfg.router_z_loss_coef * metrics["z_loss"]), metrics


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Batched expert MLPs: x [E, C, D] -> [E, C, D] with weights [E, D, F], [E, D, F], [E, F, D]."""
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x, w_gate)) * jnp.einsum("ecd,edf->ecf", x, w_up)
    return jnp.einsum("ecf,efd->ecd", h, w_down)


def dense_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """Every expert on every token, masked by the routing: the reference."""
    combine = jnp.sum(jax.nn.one_hot(experts, w["w_gate"].shape[0], dtype=F32) * weights[..., None], axis=1)
    y = swiglu(jnp.broadcast_to(x, (w["w_gate"].shape[0], *x.shape)), w["w_gate"], w["w_up"], w["w_down"])
    return jnp.einsum("end,ne->nd", y, combine.astype(y.dtype))


def dropless_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """Assignments sorted by expert, grouped matmuls, unsorted and combined: nothing dropped."""
    n, k = experts.shape
    flat = experts.reshape(-1)                        # [N*k] assignment -> expert
    order = jnp.argsort(flat, stable=True)            # assignments grouped by expert
    sizes = jnp.bincount(flat, length=w["w_gate"].shape[0])
    xs = x[order // k]                                # [N*k, D] each assignment's token, in expert order
    h = jax.nn.silu(lax.ragged_dot(xs, w["w_gate"], sizes)) * lax.ragged_dot(xs, w["w_up"], sizes)
    ys = lax.ragged_dot(h, w["w_down"], sizes)        # [N*k, D]
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to (token, choice) order
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments an expert takes: ceil(factor * tokens * k / E), at most `tokens` (never needed more)."""
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / num_experts)))


def queue_positions(experts: jax.Array, num_experts: int) -> jax.Array:
    """[N, k] each assignment's place in its expert's queue: all first choices in token order,
    then all second choices, and so on (so a capacity drop takes later choices first)."""
    by_choice = experts.T.reshape(-1)                              # [k*N], choice-major
    one_hot = jax.nn.one_hot(by_choice, num_experts, dtype=jnp.int32)
    ahead = jnp.cumsum(one_hot, axis=0) - one_hot                   # assignments queued before this one
    return jnp.sum(ahead * one_hot, axis=-1).reshape(experts.shape[::-1]).T


def capacity_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array],
                     cap: int, axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(y [N, D], assignments dropped) with at most `cap` assignments per expert from these tokens.

    With `axis` (inside a shard_map manual over it) the experts' weights are this device's E/n
    and the buffer goes through all_to_all to the devices that own the experts and back."""
    n, k = experts.shape
    num_experts = w["w_gate"].shape[0] * (lax.axis_size(axis) if axis else 1)
    pos = queue_positions(experts, num_experts)
    kept = pos < cap
    slot = jnp.where(kept, experts * cap + pos, num_experts * cap)  # a dropped assignment writes a spare row
    tokens = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    buf = jnp.zeros((num_experts * cap + 1, x.shape[-1]), x.dtype).at[slot.reshape(-1)].set(x[tokens.reshape(-1)])
    buf = buf[:-1].reshape(num_experts, cap, -1)                    # [E, C, D]
    if axis is not None:  # [E, C, D] -> [E/n, n*C, D]: my experts' rows from every device
        buf = lax.all_to_all(buf, axis, split_axis=0, concat_axis=1, tiled=True)
    out = swiglu(buf, w["w_gate"], w["w_up"], w["w_down"])
    if axis is not None:  # and back: [E/n, n*C, D] -> [E, C, D], the rows of my tokens
        out = lax.all_to_all(out, axis, split_axis=1, concat_axis=0, tiled=True)
    out = jnp.concatenate([out.reshape(num_experts * cap, -1), jnp.zeros((1, out.shape[-1]), out.dtype)])
    ys = out[slot]                                                  # [N, k, D], zeros where dropped
    y = jnp.einsum("nkd,nk->nd", ys, (weights * kept).astype(ys.dtype))
    return y, jnp.sum(~kept).astype(F32)


def _local_moe(x: jax.Array, p: dict[str, jax.Array], top_k: int, routing: str, capacity_factor: float,
               axis: str | None, token_axes: tuple[str, ...] = ()) -> tuple[jax.Array, RouterStats]:
    """One device's MoE layer on its tokens (under EP over `axis`, `p`'s experts are this device's;
    the statistics are summed over `token_axes`, the axes the tokens are split over)."""
    weights, experts, stats = route(x, p["router"], top_k)
    w = {name: p[name].astype(x.dtype) for name in ("w_gate", "w_up", "w_down")}
    num_experts = p["router"].shape[-1]
    if axis is None and routing == "dense":
        y = dense_experts(x, weights, experts, w)
    elif axis is None and routing == "dropless":
        y = dropless_experts(x, weights, experts, w)
    else:
        cap = x.shape[0] if routing != "capacity" else capacity(x.shape[0], top_k, num_experts, capacity_factor)
        y, dropped = capacity_experts(x, weights, experts, w, cap, axis)
        stats = stats._replace(dropped=dropped)
    if token_axes:  # the statistics of the whole batch, on every device
        stats = RouterStats(*lax.psum(tuple(stats), token_axes))
    return y, stats


def moe_mlp(x: jax.Array, p: dict[str, jax.Array], *, top_k: int, routing: str = "dropless",
            capacity_factor: float = 1.25) -> tuple[jax.Array, RouterStats]:
    """The sparse MLP on tokens x [N, D]: (y [N, D], router stats summed over all N tokens).

    p: 'router' [D, E], 'w_gate'/'w_up' [E, D, F], 'w_down' [E, F, D]. With dp > 1 in the current
    mesh the experts are split over dp and the tokens travel by all_to_all (expert parallelism),
    in a `shard_map` over the axes the tokens are split over; inside a shard_map manual over dp
    already (the step's, `pjax/parallel/data_parallel.reduce_once`, or a pipeline's), x and p
    are this device's tokens and E/dp experts, and the layer runs on them directly."""
    if routing not in ROUTINGS:
        raise ConfigError(f"moe.routing={routing!r} is invalid; choose one of {', '.join(ROUTINGS)}.")
    mesh = jax.sharding.get_abstract_mesh()
    dp = 1 if mesh.empty or DP not in mesh.shape else mesh.shape[DP]
    num_experts = p["router"].shape[-1]
    if dp == 1:
        return _local_moe(x, p, top_k, routing, capacity_factor, None)
    if num_experts % dp:
        raise ConfigError(f"model.num_local_experts={num_experts} is not divisible by mesh.dp={dp}; expert "
                          f"parallelism gives each dp device the same number of experts.")
    # Manual over every axis the tokens are split over (dp, and cp with context parallelism: each
    # cp rank then exchanges its own tokens with the dp group that holds its experts, which are
    # replicated over cp), so that no token dimension is left for the partitioner inside.
    token_axes = (DP, CP) if mesh.shape.get(CP, 1) > 1 else (DP,)
    # Inside the step's own shard_map over the data axes (the once-per-step gradient reduction,
    # `pjax/parallel/data_parallel.py`, and a pipeline's), x and p are this device's already.
    local = lambda x, p: _local_moe(x, p, top_k, routing, capacity_factor, DP, token_axes)
    if DP in mesh.manual_axes:
        # A pipeline stage would keep the layer's dispatch buffers ([E, C, D]; under dropless E/k
        # times the tokens) in the slot of every micro-batch in flight: it keeps only the layer's
        # input and runs it again in the backward (measured: benchmarks/README.md).
        return (jax.checkpoint(local) if PP in mesh.manual_axes else local)(x, p)
    experts = logical_to_spec(("experts",))  # the rules table: experts over dp
    specs = {"router": P(), "w_gate": experts, "w_up": experts, "w_down": experts}
    sharded = _differentiated_inside if PP in mesh.manual_axes else _sharded
    return sharded(local, token_axes, specs)(x, p)


def _sharded(local: Callable, token_axes: tuple[str, ...], specs: dict) -> Callable:
    """`local` on every device's tokens: a shard_map manual over the token axes."""
    return jax.shard_map(local, axis_names=set(token_axes), in_specs=(P(token_axes), specs),
                         out_specs=(P(token_axes), RouterStats(*[P()] * 5)))


def _differentiated_inside(local: Callable, token_axes: tuple[str, ...], specs: dict) -> Callable:
    """`_sharded(local)` whose gradient is taken inside a shard_map too (the forward run again there).

    Inside a pipeline stage (a shard_map manual over pp, with dp left automatic: ZeRO-3) JAX's own
    differentiation of this nested shard_map gives its saved residuals a spec over pp as well as
    dp (jax 0.10: the residual specs take every axis a value varies over, the outer manual ones
    included), and the program fails verification. Differentiating `local` per device, inside a shard_map of its own, keeps the
    residuals inside: each device saves (x, p) and reruns its forward in the backward. (Inside a
    lax.scan over layers the same residuals are hoisted out of the scan, so pipeline stages with
    expert parallelism run their layers unrolled: `pjax/parallel/pipeline/stage.py`.)"""
    forward = _sharded(local, token_axes, specs)

    def differentiable(x, p):  # the counts in the statistics (tokens, assigned, dropped) have no gradient
        y, stats = local(x, p)
        return y, (stats.prob, stats.z)

    def per_device(x, p, ct):
        ct_y, ct_stats = ct
        return jax.vjp(differentiable, x, p)[1]((ct_y, (ct_stats.prob, ct_stats.z)))

    backward = jax.shard_map(per_device, axis_names=set(token_axes),
                             in_specs=(P(token_axes), specs, (P(token_axes), RouterStats(*[P()] * 5))),
                             out_specs=(P(token_axes), specs))
    run = jax.custom_vjp(forward)
    run.defvjp(lambda x, p: (forward(x, p), (x, p)), lambda saved, ct: backward(*saved, ct))
    return run
