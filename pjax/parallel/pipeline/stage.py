"""What a pipeline stage runs: the LLaMA cut into embed / layers / loss, and its VJP kept in slots.

The executor (`pipeline/executor.py`) moves one *activation* from stage to stage: the hidden
states x [B*T, D], and for a Mixture-of-Experts model the router statistics of the layers run so
far (`models.moe.RouterStats`: [E] sums, a few hundred bytes). The statistics travel because
the load-balancing loss couples every MoE layer of the model: the last stage needs all of them
to compute it, and its gradient (d loss / d each expert's probability sum) is needed by every
stage's router. So the forward carries the sums on with the activation, and the backward
carries their cotangent back with the activation's: each stage adds its own layers' sums
(`layers(w, (x, stats)) = (y, stats + its sums)`), whose VJP passes the statistics' cotangent
through unchanged and into its routers. A dense model's statistics are `()`: the same code
moves nothing more.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mesh.mesh import CP, DP
from mesh.rules import logical_to_spec
from models import deferred_grads, llama
from models import sequence_parallel as seqpar

Activation = tuple[jax.Array, Any]  # (x [B*T, D], router statistics so far: RouterStats, or () when dense)


def varying(x: Any) -> Any:
    """`x` (an array or a tree) typed as varying over every manual axis of the shard_map it is in
    (pp; dp and cp too when the pipeline reduces gradients once), whatever it varied over before."""
    manual = jax.sharding.get_abstract_mesh().manual_axes

    def cast(a):
        missing = tuple(ax for ax in manual if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, x)


class Stage(NamedTuple):
    dtype: Any  # the compute dtype: activations, cotangents and the weights a stage runs with
    shared_specs: Any  # embedding / final norm / output layer specs without ZeRO (see the executor)
    embed: Callable[[Any, jax.Array], jax.Array]  # (shared params, tokens [B, T]) -> x [B*T, D]
    no_stats: Callable[[], Any]  # the router statistics before the first layer (zeros; () when dense)
    layers: Callable[..., Activation]  # (chunk weights, activation, positions[, taps: models/deferred_grads.py])
    loss: Callable[[Any, Activation, jax.Array], tuple[jax.Array, dict]]  # (shared, act, labels) -> scaled loss, router metrics
    head_keys: tuple[str, ...]  # the shared parameters the loss reads (its gradient's keys)
    tokens: str = "tokens"  # the activations' token axis: 'sp_tokens' under sequence parallelism
    taps: Callable[[Any, int], Any] | None = None  # (chunk weights, tokens) -> zero taps of its layers
    weight_grads: Callable[[Any, Any], dict] | None = None  # W: (taps' cotangents, chunk weights) -> dW
    scan: bool = True  # layers under lax.scan; unrolled, `layers` takes per-layer lists (`per_layer`)
    layer_specs: Any = None  # one layer's weights' specs (its 'layers' dim dropped), like its weights

    def per_layer(self, tree: Any) -> Any:
        """Stacked per-layer weights (or taps) as the stage's VJP takes them: as they are under the
        layer scan; unrolled, a list of one layer's each, sliced outside the VJP so that its
        residuals hold no per-micro-batch copies of the weights."""
        if self.scan:
            return tree
        return [jax.tree.map(lambda a: a[i], tree) for i in range(jax.tree.leaves(tree)[0].shape[0])]

    def stacked(self, tree: Any) -> Any:
        """`per_layer`'s inverse (for gradients)."""
        return jax.tree.map(lambda *a: jnp.stack(a), *tree) if isinstance(tree, list) else tree


def scan_lowers(experts: int, data_manual: bool) -> bool:
    """Whether a layer scan lowers inside the pipeline's shard_map (manual over pp).

    A shard_map inside a `lax.scan` inside it does not: ring attention's (manual over cp, unless
    cp is manual already) fails Shardy's verifier ("manual axis cp after free axis pp"), and
    differentiating an MoE layer's expert dispatch (manual over dp, unless dp is manual already)
    hoists its constants out of the scan with a spec over pp as well. Unrolled, both lower."""
    mesh = jax.sharding.get_abstract_mesh()
    return data_manual or (mesh.shape[CP] == 1 and not (experts and mesh.shape[DP] > 1))


def make_stage(spec: Any, scale: float, data_manual: bool = False) -> Stage:
    """A pipeline stage of `spec` (a `pjax.spec.StepSpec`); `scale` (1 / tokens in the global
    batch) turns the summed loss into the mean. `data_manual`: the executor's shard_map is manual
    over dp and cp too (ring attention and an MoE layer's dispatch then need no shard_map of
    their own)."""
    cfg, experts = spec.cfg, spec.cfg.num_local_experts
    spec = dataclasses.replace(spec, scan=spec.scan and scan_lowers(experts, data_manual))

    def layers(w, act, positions, taps=None):
        x, stats = act
        y, own = spec.layers(w, x, positions, taps)
        return y, (jax.tree.map(jnp.add, stats, own) if experts else ())

    def loss(shared, act, labels):
        total, (_, metrics) = spec.head(shared, *act, labels)
        return total * scale, metrics

    names = {k: axes for k, axes in llama.param_logical_axes(cfg).items() if k != "layers"}
    is_names = lambda x: isinstance(x, tuple)
    return Stage(
        dtype=spec.dtype,
        shared_specs=jax.tree.map(logical_to_spec, names, is_leaf=is_names),
        embed=spec.embed,
        no_stats=lambda: varying(spec.no_stats()),
        layers=layers,
        loss=loss,
        head_keys=spec.head_keys(),
        tokens=spec.tokens,
        taps=lambda w, tokens: deferred_grads.layer_taps(cfg, jax.tree.leaves(w)[0].shape[0], tokens, spec.dtype),
        weight_grads=lambda taps, w: deferred_grads.tap_weight_grads(taps, w, seqpar.active(spec.sequence_parallel)),
        scan=spec.scan,
        layer_specs=jax.tree.map(lambda n: logical_to_spec(n[1:]), llama.param_logical_axes(cfg)["layers"],
                                 is_leaf=is_names),
    )


@dataclasses.dataclass(frozen=True)
class VjpLayout:
    """How to store a stage's `jax.vjp` function and rebuild it: its pytree structure, and for
    each leaf either the index of the weight it is (not stored: the backward has the weights)
    or None (a residual: stored per micro-batch)."""

    treedef: Any
    weight_index: tuple[int | None, ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def trace(cls, fn: Callable, w: Any, *args: Any) -> "VjpLayout":
        # Traced inside the shard_map body with pp-varying inputs: a treedef traced outside
        # carries invariant types and fails on the varying cotangent later.
        _, vjp_fn = jax.vjp(fn, w, *args)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        index = cls.weights_in(vjp_fn, w)
        stored = tuple(jax.ShapeDtypeStruct(l.shape, l.dtype) for l, k in zip(leaves, index) if k is None)
        return cls(treedef, index, stored)

    @staticmethod
    def weights_in(vjp_fn: Callable, w: Any) -> tuple[int | None, ...]:
        """Per leaf of `vjp_fn`: the index of the leaf of `w` it is (the same array), or None: a residual."""
        w_leaves = jax.tree.leaves(w)
        return tuple(next((k for k, wl in enumerate(w_leaves) if leaf is wl), None)
                     for leaf in jax.tree.leaves(vjp_fn))

    def pack(self, vjp_fn: Callable) -> list[jax.Array]:
        leaves = jax.tree.leaves(vjp_fn)
        assert len(leaves) == len(self.weight_index), "the stage's VJP changed structure between traces"
        # A residual can be a pp-invariant constant; the slot buffers (and the loops carrying them) are varying.
        return [varying(leaf) for leaf, k in zip(leaves, self.weight_index) if k is None]

    def passed_through(self, backward: Callable[[list[jax.Array]], Any]) -> tuple[int | None, ...]:
        """Per output leaf of `backward(stored residuals)`: the index of the residual it is,
        unchanged (as a projection's input is in what B leaves W), or None. Under the layer scan
        such an output is the scan's stack of a residual's slices, one per layer: that counts."""
        stored = [varying(jnp.zeros(s.shape, s.dtype)) for s in self.stored]
        jaxpr = jax.make_jaxpr(lambda res: jax.tree.leaves(backward(res)))(stored).jaxpr
        index = {id(v): k for k, v in enumerate(jaxpr.invars)}
        made = {id(v): (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}

        def source(v) -> int | None:
            if id(v) in index:
                return index[id(v)]
            eqn, k = made.get(id(v), (None, 0))
            if eqn is None or eqn.primitive.name != "scan":
                return None
            body, consts, carry = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], eqn.params["num_carry"]
            if k < carry:  # a carry, not a stacked output
                return None
            j = next((i for i, u in enumerate(body.invars) if u is body.outvars[k]), None)
            # A stacked output that is the body's slice of a stacked input (forwards or reversed,
            # slice i goes to row i) is that input.
            return source(eqn.invars[j]) if j is not None and j >= consts + carry else None

        return tuple(source(v) for v in jaxpr.outvars)

    def unpack(self, w: Any, stored: list[jax.Array]) -> Callable:
        w_leaves, rest = jax.tree.leaves(w), iter(stored)
        return jax.tree.unflatten(self.treedef, [next(rest) if k is None else w_leaves[k] for k in self.weight_index])
