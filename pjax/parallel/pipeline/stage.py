"""What a pipeline stage runs: the LLaMA cut into embed / layers / loss, and its VJP kept in slots."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mesh.mesh import CP, current, data_size
from mesh.rules import logical_to_spec
from models import deferred_grads, fp8, fp8_weights, llama
from models import sequence_parallel as seqpar

Activation = tuple[jax.Array, Any]  # (x [B*T, D], router stats so far or (): ARCHITECTURE.md, "MoE in a pipeline")


def varying(x: Any) -> Any:
    """`x` (an array or a tree) cast to varying over every manual axis of the enclosing shard_map."""
    manual = current().manual_axes

    def cast(a):
        missing = tuple(ax for ax in manual if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, x)


class Stage(NamedTuple):
    precision: Any  # models.precision.Precision
    shared_specs: Any  # embedding / final norm / output layer specs without ZeRO (see the executor)
    embed: Callable[[Any, jax.Array], jax.Array]  # (shared params, tokens [B, T]) -> x [B*T, D]
    no_stats: Callable[[], Any]
    layers: Callable[..., Activation]  # (chunk weights[ and fp8 stacks: fp8_weights.with_stacks], activation,
                                       #  positions[, taps: models/deferred_grads.py])
    loss: Callable[[Any, Activation, jax.Array], tuple[jax.Array, dict]]  # (shared, act, labels) -> scaled loss, router metrics
    head_keys: tuple[str, ...]
    tokens: str = "tokens"  # the activations' token axis: 'sp_tokens' under sequence parallelism
    taps: Callable[[Any, int], Any] | None = None  # (chunk weights, tokens) -> zero taps of its layers
    weight_grads: Callable[[Any, Any], dict] | None = None  # W: (taps' cotangents, chunk weights) -> dW
    scan: bool = True
    layer_specs: Any = None
    quantize: Callable[[Any], Any] = lambda layers: None  # stacked weights -> their fp8 stacks (`StepSpec`'s) or None

    def per_layer(self, tree: Any) -> Any:
        """Stacked weights (or taps) as the VJP takes them; unrolled, slices cut outside it, so not in its residuals."""
        if self.scan:
            return tree
        return [jax.tree.map(lambda a: a[i], tree) for i in range(jax.tree.leaves(tree)[0].shape[0])]

    def stacked(self, tree: Any) -> Any:
        """`per_layer`'s inverse (for gradients)."""
        return jax.tree.map(lambda *a: jnp.stack(a), *tree) if isinstance(tree, list) else tree


def scan_lowers(experts: int, data_manual: bool) -> bool:
    """Whether a layer scan lowers inside the pipeline's shard_map: ring attention's shard_map in it fails Shardy's
    verifier ("manual axis cp after free axis pp"); an MoE dispatch's backward hoists constants with a spec over pp."""
    mesh = current()
    return data_manual or (mesh.shape[CP] == 1 and not (experts and data_size(mesh) > 1))


def make_stage(spec: Any, scale: float, data_manual: bool = False) -> Stage:
    """The stage of a `StepSpec`; `scale`: 1 / the global batch's tokens; `data_manual`: manual over dp and cp too."""
    cfg, experts = spec.cfg, spec.cfg.num_local_experts
    spec = dataclasses.replace(spec, scan=spec.scan and scan_lowers(experts, data_manual))

    def layers(w, act, positions, taps=None):
        x, stats = act
        w, quantized = fp8_weights.split_stacks(w)
        y, own = spec.layers(w, x, positions, taps, quantized)
        return y, (jax.tree.map(jnp.add, stats, own) if experts else ())

    def loss(shared, act, labels):
        total, (_, metrics) = spec.head(shared, *act, labels)
        return total * scale, metrics

    names = {k: axes for k, axes in llama.param_logical_axes(cfg).items() if k != "layers"}
    is_names = lambda x: isinstance(x, tuple)
    return Stage(
        precision=spec.precision,
        shared_specs=jax.tree.map(logical_to_spec, names, is_leaf=is_names),
        embed=spec.embed,
        no_stats=lambda: varying(spec.no_stats()),
        layers=layers,
        loss=loss,
        head_keys=spec.head_keys(),
        tokens=spec.tokens,
        taps=lambda w, tokens: deferred_grads.layer_taps(cfg, jax.tree.leaves(w)[0].shape[0], tokens, spec.precision),
        weight_grads=lambda taps, w: deferred_grads.tap_weight_grads(taps, w, seqpar.active(spec.sequence_parallel),
                                                                     fp8.gemm(spec.precision.fp8)),
        scan=spec.scan,
        quantize=spec.quantize_weights,
        layer_specs=jax.tree.map(lambda n: logical_to_spec(n[1:]), llama.param_logical_axes(cfg)["layers"],
                                 is_leaf=is_names),
    )


@dataclasses.dataclass(frozen=True)
class VjpLayout:
    """How a stage's `jax.vjp` function is stored and rebuilt: per leaf, the weight it is (not stored) or None."""

    treedef: Any
    weight_index: tuple[int | None, ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def trace(cls, fn: Callable, w: Any, *args: Any) -> "VjpLayout":
        # Traced inside the shard_map: a treedef traced outside has invariant types, failing on the varying cotangent.
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
        # A residual can be a pp-invariant constant; the slot buffers are varying.
        return [varying(leaf) for leaf, k in zip(leaves, self.weight_index) if k is None]

    def passed_through(self, backward: Callable[[list[jax.Array]], Any]) -> tuple[int | None, ...]:
        """Per output leaf of `backward(stored)`: the residual it returns unchanged (or a scan restacks), or None."""
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
            if k < carry:
                return None
            j = next((i for i, u in enumerate(body.invars) if u is body.outvars[k]), None)
            # A stacked output that is the body's slice of a stacked input is that input.
            return source(eqn.invars[j]) if j is not None and j >= consts + carry else None

        return tuple(source(v) for v in jaxpr.outvars)

    def unpack(self, w: Any, stored: list[jax.Array]) -> Callable:
        w_leaves, rest = jax.tree.leaves(w), iter(stored)
        return jax.tree.unflatten(self.treedef, [next(rest) if k is None else w_leaves[k] for k in self.weight_index])
