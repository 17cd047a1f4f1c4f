"""Logical axis names -> mesh axes: the one table that says where every tensor lives, never the model
(ARCHITECTURE.md, "One table of logical rules")."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from mesh.mesh import CP, DATA, EP, PP, RP, TP, ZERO, current

# Megatron's column/row/vocab-parallel TP falls out of splitting 'heads', 'kv_heads', 'mlp', 'vocab'.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": DATA,
    "sequence": CP,
    "tokens": (*DATA, CP),
    # Sequence parallelism: tp inside each (dp, cp) block, so a gather over tp gives back 'tokens'.
    "sp_tokens": (*DATA, CP, TP),
    # The tp part of a (dp, cp) block's tokens, as its own dimension (the chunked loss's blocks under SP).
    "sp_part": TP,
    "embed": None,
    "heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "vocab": TP,
    "layers": None,
    "experts": EP,  # copied over dp's replicas of the expert group
}

# ZeRO: every LLaMA weight has exactly one 'embed' dimension, so one rule shards them all over dp x ep (all of data
# parallelism, or a shard group under train.zero_shard: copied over rp).
FSDP_OVERRIDES: dict[str, str | tuple[str, ...] | None] = {"embed": ZERO}
PIPELINE_OVERRIDES: dict[str, str | None] = {"layers": PP}


def param_rules(zero_sharded: bool, pipelined: bool = False) -> dict[str, str | tuple[str, ...] | None]:
    """The table for parameters and optimizer state."""
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
    """Pin an activation's sharding by logical names, bar manual axes (ARCHITECTURE.md, "Activations are pinned")."""
    return _pinned(x, logical_to_spec(names))


def _pinned(x: jax.Array, spec: P) -> jax.Array:
    """`x` constrained to `spec` on the ambient mesh, its manual axes left out."""
    mesh = current()
    if mesh.empty:
        return x
    manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}

    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in manual)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return jax.lax.with_sharding_constraint(x, P(*(keep(e) for e in spec)))


def by_shard_groups(x: jax.Array, tokens: str = "tokens") -> jax.Array:
    """`x` ([tokens, embed], read from a weight ZeRO shards; `tokens` its rows' logical name) and its cotangent laid
    out, where ZeRO's shard groups have copies (rp > 1: HSDP's ZeRO-3), as rows over rp and 'embed' over the rows'
    other axes (the shard group's dp x ep, and cp, tp where they split tokens). The embedding's lookup then reaches
    its rows by an all-to-all within each group, and its scatter-add sums each group's rows into that group's
    shards, the groups meeting in one all-reduce over rp. Left to itself XLA goes between rows over all the data
    axes and the weight's layout by replicating the whole tensor."""
    spec = _group_spec(tokens)
    return x if spec is None else _by_groups(x, spec)


def in_shard_groups(x: jax.Array, tokens: str = "tokens") -> jax.Array:
    """`by_shard_groups`'s layout, for a cotangent a hand-written backward hands a weight's scatter-add."""
    spec = _group_spec(tokens)
    return x if spec is None else _pinned(x, spec)


def _group_spec(tokens: str) -> P | None:
    if auto_size(current(), RP) == 1:
        return None
    return P(RP, tuple(a for a in RULES[tokens] if a != RP))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _by_groups(x: jax.Array, spec: P) -> jax.Array:
    return _pinned(x, spec)


def _by_groups_fwd(x, spec):
    return _pinned(x, spec), None


def _by_groups_bwd(spec, _, ct):
    return (_pinned(ct, spec),)


_by_groups.defvjp(_by_groups_fwd, _by_groups_bwd)


def rows_axes(axes: Sequence[str]) -> tuple[str, ...] | None:
    """Those of `axes` that split a batch's rows (rp, dp, ep), as one spec or collective axis (None if none)."""
    return tuple(a for a in DATA if a in axes) or None


def zero_axes(axes: Sequence[str]) -> tuple[str, ...] | None:
    """Those of `axes` ZeRO shards over (dp, ep: not rp, whose groups hold copies), as one axis (None if none)."""
    return tuple(a for a in ZERO if a in axes) or None


def auto_size(mesh, axis: str) -> int:
    """Size of a mesh axis that is still partitioned automatically (1 if absent or Manual)."""
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Manual:
        return 1
    return mesh.shape[axis]


def auto_rows(mesh) -> int:
    """How many ways a batch's rows are still split automatically: rp x dp x ep's automatic part."""
    return math.prod(auto_size(mesh, a) for a in DATA)


def manual_size(mesh, axis: str) -> int:
    """Size of a mesh axis an enclosing shard_map has made manual (1 if absent or automatic)."""
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis] // auto_size(mesh, axis)


def per_device(fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
    """`fn` on each device's blocks along the automatic axes its specs name, for hand-written collectives;
    on the ambient mesh (it knows which axes an enclosing shard_map made manual)."""
    ref = current()
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


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` cast to varying over the manual `axes` (each leaf's missing ones): its gradient stays a local
    partial sum, and a shard_map may hand it out split over those axes."""
    def cast(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def flatten_tokens(x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B*T, ...] in (dp, cp) block order, so that the merge moves nothing between
    devices (ARCHITECTURE.md, "Block-order token flattening")."""
    b, t, *rest = x.shape
    mesh = current()
    dp, cp = auto_rows(mesh), auto_size(mesh, CP)
    if cp == 1 or b % dp or t % cp:
        return x.reshape(b * t, *rest)
    x = x.reshape(dp, b // dp, cp, t // cp, *rest).swapaxes(1, 2)
    return x.reshape(b * t, *rest)


def unflatten_tokens(x: jax.Array, b: int, t: int) -> jax.Array:
    """The inverse of `flatten_tokens`: [B*T, ...] -> [B, T, ...]."""
    rest = x.shape[1:]
    mesh = current()
    dp, cp = auto_rows(mesh), auto_size(mesh, CP)
    if cp == 1 or b % dp or t % cp:
        return x.reshape(b, t, *rest)
    x = x.reshape(dp, cp, b // dp, t // cp, *rest).swapaxes(1, 2)
    return x.reshape(b, t, *rest)
