"""Logical axis names -> mesh axes: the one table that says where every tensor lives.

The model names the dimensions of its parameters and activations ('embed', 'heads', ...);
these rules turn the names into `PartitionSpec`s. Changing the parallel layout means changing
this table, never the model.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from mesh.mesh import CP, DP, PP, TP

# Activations and parameters share one table. Megatron-style tensor parallelism falls out of it:
# q/k/v/gate/up are column-parallel because their output dims ('heads', 'kv_heads', 'mlp') are
# split over tp; o/down are row-parallel because their input dims are; the embedding and the
# output layer are vocab-parallel. 'layers' (the stacked-layer dim) stays None here: under plain
# jit nothing splits it. With pp > 1 the parameters use PIPELINE_OVERRIDES (each pipeline stage
# holds its own layers), and pjax/parallel/pipeline/step.py runs the stages.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": DP,
    "sequence": CP,
    # Matmul activations are kept 2-D, [batch*sequence, embed] ('tokens'), merged in block order
    # by `flatten_tokens` so that a (dp, cp) split of the merged dim is exactly "batch over dp,
    # sequence over cp" and merging never moves data between devices.
    "tokens": (DP, CP),
    # Sequence parallelism (`train.sequence_parallel`, models/sequence_parallel.py): between the
    # tensor-parallel regions the residual stream's tokens are split over tp too, inside each
    # device's (dp, cp) block, so gathering them over tp gives back exactly the 'tokens' block.
    "sp_tokens": (DP, CP, TP),
    "embed": None,
    "heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "vocab": TP,
    "layers": None,
    # Mixture of Experts: the experts of a layer are split over dp, where the tokens already are
    # (expert parallelism without a fifth axis, as GShard and DeepSpeed-MoE do); tokens reach their
    # experts by all_to_all over dp (models/moe.py). Each expert's MLP is split over tp like the
    # dense one ('mlp').
    "experts": DP,
}

# ZeRO-1 (optimizer state) and ZeRO-3/FSDP (parameters too) additionally split every
# parameter's 'embed' dimension over dp. Every LLaMA weight has exactly one 'embed' dimension,
# so one rule covers all of them; activations keep 'embed' whole (their batch is split instead).
FSDP_OVERRIDES: dict[str, str | None] = {"embed": DP}
PIPELINE_OVERRIDES: dict[str, str | None] = {"layers": PP}


def param_rules(zero_sharded: bool, pipelined: bool = False) -> dict[str, str | tuple[str, ...] | None]:
    """The table for parameters (and optimizer state): RULES, plus 'embed'->dp when ZeRO-sharded
    and 'layers'->pp when pipelined."""
    return {**RULES, **(FSDP_OVERRIDES if zero_sharded else {}), **(PIPELINE_OVERRIDES if pipelined else {})}


def logical_to_spec(names: Sequence[str | None], rules: dict | None = None) -> P:
    """PartitionSpec for a tensor whose dimensions carry these logical names."""
    rules = RULES if rules is None else rules
    spec = []
    for name in names:
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        spec.append(None if name is None else rules[name])
    return P(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's sharding by logical names (a no-op when no mesh is set).

    Without these hints XLA's propagation may pick the weights' sharding for the activations
    (e.g. split the contracting dim under FSDP and all-reduce activations instead of gathering
    weights), so the model constrains at layer boundaries and around the loss.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    # Inside a shard_map that is manual over some axes (dp for the once-per-step gradient
    # reduction, pp in a pipeline stage), arrays are already local blocks along those axes.
    manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}

    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in manual)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return jax.lax.with_sharding_constraint(x, P(*(keep(e) for e in logical_to_spec(names))))


def auto_size(mesh, axis: str) -> int:
    """Size of a mesh axis that is still partitioned automatically (1 if absent or Manual)."""
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Manual:
        return 1  # inside a shard_map over this axis: the arrays are already local blocks
    return mesh.shape[axis]


def manual_size(mesh, axis: str) -> int:
    """Size of a mesh axis an enclosing shard_map has made manual (1 if absent or automatic): how
    many blocks of a tensor split over it there are, of which a device holds one."""
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis] // auto_size(mesh, axis)


def per_device(fn: Callable, mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`fn` on each device's blocks along the mesh axes its specs name, for hand-written collectives.

    Axes an enclosing shard_map has made manual already (the step's over dp and cp, a pipeline
    stage's over pp) are local blocks as they stand, and so are axes of size 1: they are dropped
    from the specs, and when none is left `fn` runs as it is. Otherwise it runs in a shard_map
    manual over the rest and the axes of size 1, on the context mesh where there is one (inside
    another shard_map, shard_map insists on the mesh that knows which axes are manual).
    """
    context = jax.sharding.get_abstract_mesh()
    ref = mesh if context.empty else context
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def named(spec: P) -> list[str]:
        return [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]

    todo = {a for s in jax.tree.leaves((in_specs, out_specs), is_leaf=is_spec) for a in named(s)
            if auto_size(ref, a) > 1}
    if not todo:
        return fn

    def keep(spec: P) -> P:
        return P(*(tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a in todo) or None for e in spec))

    in_specs, out_specs = (jax.tree.map(keep, s, is_leaf=is_spec) for s in (in_specs, out_specs))
    # Axes of size 1 go manual too (they split nothing): left automatic, JAX pins the reduction
    # inside a reduce-scatter to a sharding, which XLA:CPU's bf16 promotion of it cannot clone.
    ones = {a for a in ref.axis_names if a not in ref.manual_axes and ref.shape[a] == 1}
    return jax.shard_map(fn, mesh=ref, in_specs=in_specs, out_specs=out_specs, axis_names=todo | ones)


def flatten_tokens(x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B*T, ...] in block order: the dp x cp blocks of (batch, sequence) one after another.

    A plain row-major merge puts row b's whole sequence before row b+1's, so with more than one
    row per device and the sequence split over cp, the (dp, cp) split of the merged dimension
    would not be the block a device holds, and XLA would move activations around every merge.
    Ordering by (dp block, cp block, row, position) makes the merge local. The order of tokens
    in the merged dimension is irrelevant to the model (matmuls are per token; the loss is a sum).
    """
    b, t, *rest = x.shape
    mesh = jax.sharding.get_abstract_mesh()
    dp, cp = auto_size(mesh, DP), auto_size(mesh, CP)
    if cp == 1 or b % dp or t % cp:
        return x.reshape(b * t, *rest)
    x = x.reshape(dp, b // dp, cp, t // cp, *rest).swapaxes(1, 2)
    return x.reshape(b * t, *rest)


def unflatten_tokens(x: jax.Array, b: int, t: int) -> jax.Array:
    """The inverse of `flatten_tokens`: [B*T, ...] -> [B, T, ...]."""
    rest = x.shape[1:]
    mesh = jax.sharding.get_abstract_mesh()
    dp, cp = auto_size(mesh, DP), auto_size(mesh, CP)
    if cp == 1 or b % dp or t % cp:
        return x.reshape(b, t, *rest)
    x = x.reshape(dp, cp, b // dp, t // cp, *rest).swapaxes(1, 2)
    return x.reshape(b, t, *rest)
