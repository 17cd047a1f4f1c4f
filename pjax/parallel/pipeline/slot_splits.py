"""How XLA splits the slots' leaves over tp, read from compiling one stage's forward and B: a cotangent takes over a
residual's buffer only if split alike, which neither shapes nor trace show (ARCHITECTURE.md, "Zero-bubble memory")."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh.mesh import EP, TP, current
from mesh.rules import logical_to_spec, manual_size
from models import fp8_weights
from pjax.parallel.pipeline.stage import VjpLayout

Split = tuple | None  # per dimension tp or None; None: not known


def only_tp(spec: P, ndim: int) -> tuple:
    """`spec` as a Split."""
    keep = lambda e: TP if e == TP or (isinstance(e, tuple) and TP in e) else None
    return tuple(keep(e) for e in spec) + (None,) * (ndim - len(spec))


def tp_specs(fn: Callable, args: Any, in_specs: Any) -> list[tuple[jax.ShapeDtypeStruct, Split]]:
    """Per output leaf of `fn(*args)`: (shape, split over tp) as XLA compiles it, on the enclosing mesh's
    shape with every axis automatic (under `jax.jit` no other size can be entered); no device runs."""
    outer = current()
    mesh = jax.sharding.Mesh(np.array(_step_devices(outer.size)).reshape(outer.axis_sizes), outer.axis_names)
    over_tp = lambda a, s: NamedSharding(mesh, P(*only_tp(s, a.ndim)))
    shapes = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=over_tp(a, s)), args, in_specs)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).lower(*shapes).compile()
    outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree.leaves(compiled.out_info)]
    specs = [only_tp(s.spec, o.ndim) if isinstance(s, NamedSharding) else None
             for o, s in zip(outs, jax.tree.leaves(compiled.output_shardings), strict=True)]
    return list(zip(outs, specs, strict=True))


def _step_devices(size: int) -> list[jax.Device]:
    """The devices the step is compiled for (the `jax.set_mesh` mesh's: compile-only GPUs under the planner),
    else this process's first `size`. JAX 0.10 has no public way to read the concrete mesh under jit."""
    from jax._src import mesh as mesh_lib

    concrete = mesh_lib.get_concrete_mesh()
    return list(concrete.devices.flat) if not concrete.empty else jax.devices()[:size]


def align(stored: Sequence[jax.ShapeDtypeStruct], probed: Sequence[jax.ShapeDtypeStruct],
          specs: Sequence[Split]) -> list[Split]:
    """`specs` moved onto the `stored` leaves the `probed` ones are; the probe can lack some (pp-varying
    scalar constants), never have others. All None if they do not line up."""
    out, k = [], 0
    for leaf in stored:
        same = k < len(probed) and (probed[k].shape, probed[k].dtype) == (leaf.shape, leaf.dtype)
        out.append(specs[k] if same else None)
        k += same
    return out if k == len(probed) else [None] * len(stored)


def slot_splits(stage: Any, pool: Any, w: Any, act: Any, positions: jax.Array, taps: Any
                ) -> tuple[tuple[Split, ...], tuple[Split, ...]]:
    """`SlotPool.splits`: the tp split of each residual (kind 0) and each tap cotangent B writes for W (kind 1).
    Not known (None) where a stage holds only its ep block of the experts: the probe, every axis automatic,
    would read the block as all of them."""
    tapped = pool.written(1)
    if manual_size(current(), EP) > 1:
        return (None,) * len(pool.kinds[0]), (None,) * len(pool.kinds[1])

    def forward_and_b(w, act, positions, taps):
        out, vjp_fn = jax.vjp(lambda w, act, taps: stage.layers(w, act, positions, taps), w, act, taps)
        residuals = [a for a, k in zip(jax.tree.leaves(vjp_fn), VjpLayout.weights_in(vjp_fn, w)) if k is None]
        cotangents = jax.tree.leaves(vjp_fn(out)[2])
        return residuals, [cotangents[i] for i in tapped]

    one = w[0] if isinstance(w, list) else w
    _, stacks = fp8_weights.split_stacks(one)
    layer = fp8_weights.with_stacks(stage.layer_specs, stacks and fp8_weights.stack_specs(stacks, stage.layer_specs))
    w_specs = jax.tree.map(lambda s: P(None, *s), layer) if stage.scan else [layer] * len(w)
    stats = jax.tree.map(lambda _: P(), act[1])  # an MoE stage's router statistics travel replicated
    in_specs = (w_specs, (logical_to_spec((stage.tokens, "embed")), stats), P(), jax.tree.map(lambda _: P(), taps))
    found = tp_specs(forward_and_b, (w, act, positions, taps), in_specs)
    residuals, cotangents = found[:len(found) - len(tapped)], found[len(found) - len(tapped):]
    by_leaf = dict(zip(tapped, (s for _, s in cotangents)))
    return (tuple(align(pool.kinds[0], [r for r, _ in residuals], [s for _, s in residuals])),
            tuple(by_leaf.get(i) for i in range(len(pool.kinds[1]))))
