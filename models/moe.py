"""Mixture of Experts: top-k routing (renormalised over the k, Mixtral's rule) and three ways to run the experts, equal
when nothing is dropped: `dense`, `dropless` (under expert parallelism: exactly the routed rows, by ragged
all-to-all, models/ragged_dispatch.py) and `capacity` (fixed [E, C, D] shapes for the all-to-all; a token with
every choice dropped passes through the residual). Expert parallelism: ARCHITECTURE.md, "Mixture of Experts"."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh import replica_groups
from mesh.errors import ConfigError
from mesh.mesh import CP, DP, EP, PP, RP, current
from models import bias_balance, fp8_weights, grouped_gemm
from models.projection import Quantized
from models.ragged_dispatch import ragged_experts, receive_rows

ROUTINGS = ("dropless", "capacity", "dense")
ROUTER_METRICS = ("aux_loss", "z_loss", "dropped_fraction", "load_min", "load_max")
F32 = jnp.float32


class Gemms(NamedTuple):
    """The experts' matmuls: plain (the grouped GEMM: tokamax's kernel on GPUs, `models/grouped_gemm.py`), or
    fp8's (`models.fp8.einsum`, `models.fp8.ragged_dot`: `precision.fp8`)."""

    einsum: Callable = jnp.einsum
    ragged_dot: Callable = grouped_gemm.ragged_dot


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """How MoE layers run (the `moe` config section); the experts themselves are model keys."""

    routing: str = "dropless"
    capacity_factor: float = 1.25
    # Dropless under expert parallelism: the rows a device receives, in even shares (tokens x k); None: the
    # bound that never drops (every device's every assignment). Past it assignments drop (dropped_fraction).
    receive_factor: float | None = None
    # Sigmoid routing's selection bias moves by this much per step against each expert's load (DeepSeek-V3's
    # gamma; 0 holds it, as for fine-tuning). Read only with model.router_score=sigmoid.
    bias_update_rate: float = 0.001

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"moe.routing={self.routing!r} is invalid; choose one of {', '.join(ROUTINGS)}.")
        rate = self.bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
            raise ConfigError(f"moe.bias_update_rate={rate!r} is invalid; use a number >= 0 (0 holds the bias).")
        for key in ("capacity_factor", "receive_factor"):
            value = getattr(self, key)
            if (value is not None or key == "capacity_factor") and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                hint = "a number > 0" + (" or null (never drop)" if key == "receive_factor" else "")
                raise ConfigError(f"moe.{key}={value!r} is invalid; use {hint}.")


class RouterStats(NamedTuple):
    """Sums over tokens, so they add across devices, micro-batches and layers (z: of logsumexp^2)."""

    tokens: jax.Array
    assigned: jax.Array  # [E], before any drop
    prob: jax.Array
    z: jax.Array
    dropped: jax.Array


SCORES = ("softmax", "sigmoid")


class Router(NamedTuple):
    """How a token picks its experts: the top k of the scores, their weights renormalised to sum to 1 (Mixtral's
    rule; `model.norm_topk_prob=false`: Qwen3-MoE's option to keep the scores themselves). The scores are a softmax
    (Mixtral, Qwen), or each expert's own sigmoid (`model.router_score=sigmoid`, DeepSeek-V3's), whose choice a
    per-expert bias moves (`models/bias_balance.py`)."""

    top_k: int
    normalize: bool = True
    score: str = "softmax"


def route(x: jax.Array, w_router: jax.Array, router: Router, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, RouterStats]:
    """(weights [N, k] fp32, experts [N, k] int32, stats) for tokens x [N, D]; `bias` [E] selects, never weighs."""
    with jax.named_scope("router"):  # not fp8 (torchao's recipe): the compiled step's op names tell it apart
        logits = jnp.einsum("nd,de->ne", x.astype(w_router.dtype), w_router, preferred_element_type=F32)
    if router.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # the balancing loss's share (DeepSeek-V3's)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        top, experts = lax.top_k(scores, router.top_k)
    else:
        experts = lax.top_k(scores + lax.stop_gradient(bias).astype(F32), router.top_k)[1]
        top = jnp.take_along_axis(scores, experts, axis=-1)
    weights = top / jnp.sum(top, axis=-1, keepdims=True) if router.normalize else top
    num_experts = w_router.shape[-1]
    stats = RouterStats(tokens=jnp.asarray(x.shape[0], F32),
                        assigned=jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=F32), axis=(0, 1)),
                        prob=jnp.sum(probs, axis=0),
                        z=jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
                        dropped=jnp.zeros((), F32))
    if bias is not None:  # the layer's load comes back as the bias' gradient
        weights = bias_balance.tapped(weights, bias, stats.assigned)
    return weights, experts.astype(jnp.int32), stats


def aux_losses(stats: RouterStats, layers: int = 1) -> dict[str, jax.Array]:
    """ROUTER_METRICS from stats summed over `layers` MoE layers; aux_loss in HF's Mixtral form (k
    when routing is uniform), load_min/max relative to a uniform share."""
    tokens = stats.tokens / layers  # per layer
    num_experts = stats.assigned.shape[-1]
    f = stats.assigned / (layers * tokens)
    p = stats.prob / (layers * tokens)
    share = stats.assigned / jnp.sum(stats.assigned) * num_experts
    return {"aux_loss": num_experts * jnp.sum(f * p), "z_loss": stats.z / (layers * tokens),
            "dropped_fraction": stats.dropped / jnp.sum(stats.assigned),
            "load_min": jnp.min(share), "load_max": jnp.max(share)}


def router_loss(stats: RouterStats, count: jax.Array, cfg: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(what an MoE model adds to a micro-batch's cross-entropy summed over `count` tokens, the router metrics)."""
    metrics = aux_losses(stats, cfg.num_hidden_layers)
    return count * (cfg.router_aux_loss_coef * metrics["aux_loss"] + cfg.router_z_loss_coef * metrics["z_loss"]), metrics


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, gemms: Gemms = Gemms()) -> jax.Array:
    """Batched expert MLPs: x [E, C, D] -> [E, C, D] with weights [E, D, F], [E, D, F], [E, F, D]."""
    h = jax.nn.silu(gemms.einsum("ecd,edf->ecf", x, w_gate)) * gemms.einsum("ecd,edf->ecf", x, w_up)
    return gemms.einsum("ecf,efd->ecd", h, w_down)


def dense_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array],
                  gemms: Gemms = Gemms()) -> jax.Array:
    """Every expert on every token, masked by the routing: the reference."""
    combine = jnp.sum(jax.nn.one_hot(experts, w["w_gate"].shape[0], dtype=F32) * weights[..., None], axis=1)
    y = swiglu(jnp.broadcast_to(x, (w["w_gate"].shape[0], *x.shape)), w["w_gate"], w["w_up"], w["w_down"], gemms)
    return jnp.einsum("end,ne->nd", y, combine.astype(y.dtype))


def grouped_swiglu(xs: jax.Array, w: dict[str, jax.Array], sizes: jax.Array, gemms: Gemms = Gemms()) -> jax.Array:
    """The experts' MLPs as grouped GEMMs: rows xs [M, D] sorted by expert, `sizes` [E] rows each (the rest: 0)."""
    h = jax.nn.silu(gemms.ragged_dot(xs, w["w_gate"], sizes)) * gemms.ragged_dot(xs, w["w_up"], sizes)
    return gemms.ragged_dot(h, w["w_down"], sizes)


def dropless_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array],
                     gemms: Gemms = Gemms()) -> jax.Array:
    """Assignments sorted by expert, grouped matmuls, unsorted and combined: nothing dropped."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    ys = grouped_swiglu(x[order // k], w, jnp.bincount(flat, length=w["w_gate"].shape[0]), gemms)
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to (token, choice) order
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments an expert takes: ceil(factor * tokens * k / E), at most `tokens` (never needed more)."""
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / num_experts)))


def queue_positions(experts: jax.Array, num_experts: int) -> jax.Array:
    """[N, k] each assignment's place in its expert's queue, choice-major (a drop takes later choices first)."""
    by_choice = experts.T.reshape(-1)
    one_hot = jax.nn.one_hot(by_choice, num_experts, dtype=jnp.int32)
    ahead = jnp.cumsum(one_hot, axis=0) - one_hot
    return jnp.sum(ahead * one_hot, axis=-1).reshape(experts.shape[::-1]).T


def capacity_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array],
                     cap: int, axis: str | None = None, gemms: Gemms = Gemms()) -> tuple[jax.Array, jax.Array]:
    """(y [N, D], assignments dropped), at most `cap` per expert; with `axis` (manual) the weights are
    this device's E/n experts and the buffer goes by all_to_all to their owners and back."""
    n, k = experts.shape
    num_experts = w["w_gate"].shape[0] * (lax.axis_size(axis) if axis else 1)
    pos = queue_positions(experts, num_experts)
    kept = pos < cap
    slot = jnp.where(kept, experts * cap + pos, num_experts * cap)  # a dropped assignment writes a spare row
    tokens = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    buf = jnp.zeros((num_experts * cap + 1, x.shape[-1]), x.dtype).at[slot.reshape(-1)].set(x[tokens.reshape(-1)])
    buf = buf[:-1].reshape(num_experts, cap, -1)
    if axis is not None:  # [E, C, D] -> [E/n, n*C, D]: my experts' rows from every device
        buf = lax.all_to_all(buf, axis, split_axis=0, concat_axis=1, tiled=True)
    out = swiglu(buf, w["w_gate"], w["w_up"], w["w_down"], gemms)
    if axis is not None:
        out = lax.all_to_all(out, axis, split_axis=1, concat_axis=0, tiled=True)
    out = jnp.concatenate([out.reshape(num_experts * cap, -1), jnp.zeros((1, out.shape[-1]), out.dtype)])
    ys = out[slot]
    y = jnp.einsum("nkd,nk->nd", ys, (weights * kept).astype(ys.dtype))
    return y, jnp.sum(~kept).astype(F32)


def _local_moe(x: jax.Array, p: dict[str, jax.Array], router: Router, config: MoeConfig, axis: str | None,
               token_axes: tuple[str, ...] = (), gemms: Gemms = Gemms()) -> tuple[jax.Array, RouterStats]:
    """One device's MoE layer (under EP over `axis`, `p` holds this device's experts)."""
    top_k = router.top_k
    weights, experts, stats = route(x, p["router"], router, p.get(bias_balance.BIAS))
    w = {name: p[name].astype(x.dtype) for name in ("w_gate", "w_up", "w_down")}
    num_experts, routing = p["router"].shape[-1], config.routing
    if axis is None and routing == "dense":
        y = dense_experts(x, weights, experts, w, gemms)
    elif axis is None and routing == "dropless":
        y = dropless_experts(x, weights, experts, w, gemms)
    elif routing == "dropless":
        rows = receive_rows(x.shape[0], top_k, lax.axis_size(axis), config.receive_factor)
        grouped = lambda xs, w, sizes: grouped_swiglu(xs, w, sizes, gemms)  # noqa: E731
        y, dropped = ragged_experts(x, weights, experts, w, axis, rows, grouped)
        stats = stats._replace(dropped=dropped)
    else:  # capacity, or the dense reference under expert parallelism (the capacity that never drops)
        cap = x.shape[0] if routing != "capacity" else capacity(x.shape[0], top_k, num_experts, config.capacity_factor)
        y, dropped = capacity_experts(x, weights, experts, w, cap, axis, gemms)
        stats = stats._replace(dropped=dropped)
    if token_axes:  # the statistics of the whole batch (of a replica group's rows: `mesh.replica_groups`)
        stats = RouterStats(*replica_groups.psum(tuple(stats), token_axes))
    return y, stats


def moe_mlp(x: jax.Array, p: dict[str, jax.Array], *, top_k: int, config: MoeConfig = MoeConfig(),
            gemms: Gemms = Gemms(), normalize: bool = True, score: str = "softmax") -> tuple[jax.Array, RouterStats]:
    """The sparse MLP on x [N, D]: (y [N, D], router stats over all N tokens); experts over ep when
    ep > 1, copied over dp. Inside a shard_map manual over the data axes already, x and p are this device's."""
    router = Router(top_k, normalize, score)
    mesh = current()
    size = lambda a: 1 if mesh.empty else mesh.shape.get(a, 1)  # noqa: E731
    if size(RP) * size(DP) * size(EP) == 1:
        return _local_moe(x, p, router, config, None, gemms=gemms)
    num_experts = p["router"].shape[-1]
    if num_experts % size(EP):
        raise ConfigError(f"model.num_local_experts={num_experts} is not divisible by mesh.ep={size(EP)}; expert "
                          f"parallelism gives each ep device the same number of experts.")
    # Manual over cp too (experts are replicated over cp): no token dimension is left to the partitioner.
    token_axes = tuple(a for a in (RP, DP, EP, CP) if size(a) > 1)
    axis = EP if size(EP) > 1 else None
    local = lambda x, p: _local_moe(x, p, router, config, axis, token_axes, gemms)  # noqa: E731
    if set(token_axes) & set(mesh.manual_axes):
        # A pipeline slot keeps the layer's input, not its dispatch buffers (ARCHITECTURE.md, "MoE in a pipeline").
        return (jax.checkpoint(local) if PP in mesh.manual_axes else local)(x, p)
    experts = P(EP) if axis else P()
    specs = {name: (fp8_weights.expert_specs(experts) if isinstance(p[name], Quantized) else experts)
             if name.startswith("w_") else P() for name in p}
    sharded = _differentiated_inside if PP in mesh.manual_axes else _sharded
    return sharded(local, token_axes, specs)(x, p)


def _sharded(local: Callable, token_axes: tuple[str, ...], specs: dict) -> Callable:
    return jax.shard_map(local, axis_names=set(token_axes), in_specs=(P(token_axes), specs),
                         out_specs=(P(token_axes), RouterStats(*[P()] * 5)))


def _differentiated_inside(local: Callable, token_axes: tuple[str, ...], specs: dict) -> Callable:
    """`_sharded(local)`, differentiated per device in a shard_map of its own (ARCHITECTURE.md, "MoE in a pipeline")."""
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
