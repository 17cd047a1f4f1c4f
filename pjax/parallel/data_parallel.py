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
too), which multiplies DP traffic by train.grad_accum. `reduce_once` makes the data axes manual
for the step (`shard_map` over dp and cp, tp stays automatic inside), lets each device
accumulate its own partial gradient, and reduces once at the end: `psum` for zero=0,
`psum_scatter` (a real reduce-scatter) to the moment slices for zero=1. cp counts as a data
axis here: each of its devices sees other tokens, so its gradients are partial sums as well.
This is what PyTorch DDP's `no_sync` does for gradient accumulation. An MoE model's expert
weights are split over dp already (expert parallelism): they enter as each device's own experts,
the layers' all_to_all's backward brings every token's gradient to the expert's owner, and
their gradients are reduced over nothing but cp; the rest of the model is reduced once as above.
* zero=3 -- ZeRO-3 / FSDP. Parameters are split like the moments; each layer's weights are
  all-gathered just before use (forward and backward) and gradients reduce-scattered. This only
  works if activations stay split over the batch -- the model pins them with `constrain`, or XLA
  would rather split the contracting dimension and all-reduce activations.

ZeRO-3 reduce-scatters every micro-batch's gradient (`pjax.step.loss_and_grads` pins the
accumulator to its dp slices). A slice of a sum needs every device's addend, so reducing once
would mean a full-size fp32 partial sum per device across the micro-batches: the memory ZeRO-3
exists to save. Tried and measured (benchmarks/README.md, "Once per step: MoE yes, ZeRO-3 no"):
the dp traffic fell to ZeRO-1's, and the memory per device rose above ZeRO-1's, with no step
time gained on CPU, so a layout that can hold that accumulator is better off with zero=1. This is
FSDP2's and MaxText's default as well (reduce-scatter per micro-batch over the sharding axis; only
a pure replica axis is reduced once).
"""
from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax import lax

from mesh import rules
from mesh.mesh import CP, DP, PP, TP
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


def can_reduce_once(mesh: Any, zero: int) -> bool:
    """Whether this step accumulates per data replica and reduces once.

    Needs a data split (dp or cp > 1) and parameters that are whole on every device (zero < 3:
    ZeRO-3 keeps its gradient in dp slices, the module docstring says why); a pipeline does the
    same in its own shard_map (`pipeline.step._run`). An MoE model's experts come in split
    over dp (each device's own, as expert parallelism holds them), its layers exchange tokens by
    all_to_all inside this shard_map, and their router statistics are summed over the data axes
    where they are computed (`models.moe`), so the load-balancing loss still sees the whole batch.
    """
    shape = {} if mesh.empty else dict(mesh.shape)
    data = shape.get(DP, 1) * shape.get(CP, 1)
    return data > 1 and zero < 3


def data_axes(mesh: Any) -> tuple[str, ...]:
    """The axes that split the tokens (dp, cp) and are longer than 1: what `reduce_once` and a
    pipeline make manual. (XLA keeps an all-reduce over groups of one device as an op of its own.)"""
    return tuple(a for a in (DP, CP) if mesh.shape[a] > 1)


def batch_spec(axes: tuple[str, ...]) -> P:
    """The [micro-batches, rows, tokens] batch split over the manual data `axes` (rows over dp, tokens over cp)."""
    return P(None, DP if DP in axes else None, CP if CP in axes else None)


def is_expert(names: tuple[str | None, ...]) -> bool:
    """An MoE expert weight: split over dp by its 'experts' dimension (expert parallelism)."""
    return "experts" in names


def data_specs(cfg: LlamaConfig, axes: tuple[str, ...], split_dp: bool = False, pipelined: bool = False) -> Any:
    """Each parameter's (or gradient's) spec in a shard_map manual over the data `axes`: experts
    over dp (each device holds its own), with `split_dp` (ZeRO-1) every other parameter's embed
    slice over dp, with `pipelined` the stacked layers over pp; tp is left to the partitioner."""
    dp = DP in axes

    def spec(names):
        entries = [PP if pipelined and name == "layers" else
                   DP if dp and (name == "experts" or split_dp and name == "embed" and not is_expert(names)) else None
                   for name in names]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    return jax.tree.map(spec, llama.param_logical_axes(cfg), is_leaf=_is_names)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` typed as varying over `axes` (a per-device copy whose gradient stays a local partial
    sum), casting only the axes a leaf does not vary over already (experts vary over dp)."""
    def cast(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def reduce_gradients(grads: Any, cfg: LlamaConfig, split_dp: bool) -> Any:
    """Inside a shard_map manual over dp and cp: sum every device's partial gradients over them,
    once. `split_dp` (ZeRO-1): a reduce-scatter over dp to each parameter's embed slice, then an
    all-reduce of the slice over cp. Expert weights are summed over cp only: the all_to_all's
    backward has brought every dp device's tokens' gradient to the device that owns the expert."""
    axes = data_axes(jax.sharding.get_abstract_mesh())
    leaves, treedef = jax.tree.flatten(grads)
    names = jax.tree.leaves(llama.param_logical_axes(cfg), is_leaf=_is_names)
    dense = [i for i, n in enumerate(names) if not is_expert(n)]
    experts = [i for i, n in enumerate(names) if is_expert(n)]
    if split_dp:
        reduced = _psum([_scatter_over_dp(leaves[i], names[i]) for i in dense], tuple(a for a in axes if a == CP))
    else:
        reduced = _psum([leaves[i] for i in dense], axes)
    reduced += _psum([leaves[i] for i in experts], tuple(a for a in axes if a != DP))
    by_index = dict(zip(dense + experts, reduced))
    return jax.tree.unflatten(treedef, [by_index[i] for i in range(len(leaves))])


def _psum(xs: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """One all-reduce of the list over `axes` (XLA combines it into a tuple), or the list itself over none."""
    return lax.psum(xs, axes) if axes else xs


def _scatter_over_dp(g: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Reduce-scatter one gradient over dp along its 'embed' dimension, in a shard_map nested manual over tp.

    Left automatic, tp would be gathered first: XLA's partitioner replicates a reduce-scatter's
    operand over the axes a shard_map leaves to it (an all-reduce it keeps split)."""
    tp_only = P(*(TP if entry == TP else None for entry in logical_to_spec(names)))
    scatter = lambda x: lax.psum_scatter(x, DP, scatter_dimension=names.index("embed"), tiled=True)  # noqa: E731
    return rules.per_device(scatter, jax.sharding.get_abstract_mesh(), tp_only, tp_only)(g)


def reduce_once(accumulate: Any, params: Any, batch: Any, cfg: LlamaConfig, zero: int) -> tuple[jax.Array, Any, Any]:
    """Mean loss, gradients and router metrics with one reduction over the data axes (dp and cp) per step.

    `accumulate(params, batch) -> (loss_sum, token_count, grad_sum, router_metrics)` runs on each
    device's rows and sequence chunk: cp is manual here too, so ring attention runs its
    per-device ring directly (`context.ring.ring_attention`) and every token's gradient stays
    a local partial sum until the end. ZeRO-1 reduce-scatters over dp and all-reduces the slice
    over cp. An MoE model's experts come in as each device's own (`data_specs`) and their
    gradients are not reduced over dp (`reduce_gradients`); its router metrics are of the whole
    batch already.
    """
    axes = data_axes(jax.sharding.get_abstract_mesh())
    split_dp = zero == 1 and DP in axes

    def body(params, batch):
        loss, count, grads, router = accumulate(vary(params, axes), batch)
        loss, count = lax.psum((loss, count), axes)
        grads = reduce_gradients(grads, cfg, split_dp)
        return loss / count, jax.tree.map(lambda g: g / count, grads), router

    specs = (P(), data_specs(cfg, axes, split_dp), P())
    return jax.shard_map(body, in_specs=(data_specs(cfg, axes), batch_spec(axes)), out_specs=specs,
                         axis_names=set(axes))(params, batch)
