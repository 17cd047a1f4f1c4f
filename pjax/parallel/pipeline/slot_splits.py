"""How XLA splits the slots' leaves over tp, read from a compile of one stage.

With tp > 1 a pipeline device's slots keep a buffer per leaf (`pipeline/slots.py`), and what B
leaves W (the projections' output cotangents) can take over the buffer of a residual B has
read, as the flat rows let it at tp = 1, but only where the two are split alike over tp. Shapes
alone do not say so: the layer input [N, D] is whole on each tp device and q's cotangent of the
same shape split by heads, and a leaf written into a buffer split otherwise is moved by
collectives at every write and read. Nor does the trace: XLA's sharding propagation decides
a residual's split from the weights'. So `slot_splits` compiles the stage's forward and B once,
on a mesh shaped like the enclosing one with every axis automatic, and reads the split XLA gave
each residual and each cotangent B leaves W (`tp_specs`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh.mesh import TP
from mesh.rules import logical_to_spec
from pjax.parallel.pipeline.stage import VjpLayout

Split = tuple | None  # per dimension of a leaf, tp or None (its split over tp alone); None: not known


def only_tp(spec: P, ndim: int) -> tuple:
    """`spec` of an array of `ndim` dimensions as a Split: per dimension, tp or None."""
    keep = lambda e: TP if e == TP or (isinstance(e, tuple) and TP in e) else None
    return tuple(keep(e) for e in spec) + (None,) * (ndim - len(spec))


def tp_specs(fn: Callable, args: Any, in_specs: Any) -> list[tuple[jax.ShapeDtypeStruct, Split]]:
    """Per output leaf of `fn(*args)`: its shape and split over tp as XLA compiles it, with `args`
    (arrays or ShapeDtypeStructs) split over tp as `in_specs` say. The mesh has the enclosing
    (abstract) mesh's shape, every axis automatic: under `jax.jit` a mesh of another size cannot
    be entered. Only the compiler runs: no device is touched."""
    outer = jax.sharding.get_abstract_mesh()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:outer.size]).reshape(outer.axis_sizes), outer.axis_names)
    over_tp = lambda a, s: NamedSharding(mesh, P(*only_tp(s, a.ndim)))
    shapes = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=over_tp(a, s)), args, in_specs)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).lower(*shapes).compile()
    outs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree.leaves(compiled.out_info)]
    specs = [only_tp(s.spec, o.ndim) if isinstance(s, NamedSharding) else None
             for o, s in zip(outs, jax.tree.leaves(compiled.output_shardings), strict=True)]
    return list(zip(outs, specs, strict=True))


def align(stored: Sequence[jax.ShapeDtypeStruct], probed: Sequence[jax.ShapeDtypeStruct],
          specs: Sequence[Split]) -> list[Split]:
    """`specs` of the `probed` leaves moved onto the `stored` ones they are, in order: the probe's
    trace can lack leaves of the executor's (pp-varying scalar constants), never have others.
    All None if the two do not line up that way."""
    out, k = [], 0
    for leaf in stored:
        same = k < len(probed) and (probed[k].shape, probed[k].dtype) == (leaf.shape, leaf.dtype)
        out.append(specs[k] if same else None)
        k += same
    return out if k == len(probed) else [None] * len(stored)


def slot_splits(stage: Any, pool: Any, w: Any, act: Any, positions: jax.Array, taps: Any
                ) -> tuple[tuple[Split, ...], tuple[Split, ...]]:
    """`pool.splits` for a zero-bubble slot pool (`slots.SlotPool`) of `stage`: the tp split of
    each residual its forward stores (kind 0) and of each taps' cotangent B writes for W (kind 1;
    None for those it does not write). `w`: one chunk's weights as the stage's VJP takes them
    (`Stage.per_layer`); `act`, `positions`, `taps`: as the executor passes them."""
    tapped = pool.written(1)

    def forward_and_b(w, act, positions, taps):
        out, vjp_fn = jax.vjp(lambda w, act, taps: stage.layers(w, act, positions, taps), w, act, taps)
        residuals = [a for a, k in zip(jax.tree.leaves(vjp_fn), VjpLayout.weights_in(vjp_fn, w)) if k is None]
        cotangents = jax.tree.leaves(vjp_fn(out)[2])
        return residuals, [cotangents[i] for i in tapped]

    layer = stage.layer_specs
    w_specs = jax.tree.map(lambda s: P(None, *s), layer) if stage.scan else [layer] * len(w)
    in_specs = (w_specs, (logical_to_spec((stage.tokens, "embed")), ()), P(), jax.tree.map(lambda _: P(), taps))
    found = tp_specs(forward_and_b, (w, act, positions, taps), in_specs)
    residuals, cotangents = found[:len(found) - len(tapped)], found[len(found) - len(tapped):]
    by_leaf = dict(zip(tapped, (s for _, s in cotangents)))
    return (tuple(align(pool.kinds[0], [r for r, _ in residuals], [s for _, s in residuals])),
            tuple(by_leaf.get(i) for i in range(len(pool.kinds[1]))))
