"""Logical axis names -> mesh axes: the one table that says where every tensor lives.

The model names the dimensions of its parameters and activations ('embed', 'heads', ...);
these rules turn the names into `PartitionSpec`s. Changing the parallel layout means changing
this table, never the model.
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import PartitionSpec as P

from mesh.mesh import CP, DP, PP, TP

# Activations and parameters share one table. Megatron-style tensor parallelism falls out of it:
# q/k/v/gate/up are column-parallel because their output dims ('heads', 'kv_heads', 'mlp') are
# split over tp; o/down are row-parallel because their input dims are; the embedding and the
# output layer are vocab-parallel. 'layers' (the stacked-layer dim) stays None here: under plain
# jit nothing splits it. With pp > 1 the parameters use PIPELINE_OVERRIDES (each pipeline stage
# holds its own layers), and pjax/parallel/pipeline_parallel.py runs the stages.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": DP,
    "sequence": CP,
    # Matmul activations are kept 2-D, [batch*sequence, embed] ('tokens'): row-major merging
    # makes a (dp, cp) split of the merged dim exactly "batch over dp, sequence over cp".
    "tokens": (DP, CP),
    "embed": None,
    "heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "vocab": TP,
    "layers": None,
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
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names))
