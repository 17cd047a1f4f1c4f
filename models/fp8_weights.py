"""GEMM weights quantized once per step, before the micro-batch loop (ARCHITECTURE.md, "fp8 GEMMs"): each layer's
dense weights in e4m3, grouped as its GEMMs merge them (q, k, v; gate, up), with one power-of-two scale per layer
and group; its experts' weights with one scale per layer and device's block of experts, as their GEMMs scale them.
A layer reads them as `projection.Quantized` weights, so its fp8 GEMMs multiply these fp8 values and never
quantize a weight again; gradients still reach the fp32 masters through the layer's own cast.

Each fp8 value and scale is the one the GEMM made of its weight (same cast, same merge, same amax), so a step's
numbers do not change; what changes is that a weight is quantized once, not once per micro-batch, and that the
loop holds one byte per weight in the GEMM's layout in place of a transposed fp32 copy."""
from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.mesh import CP, EP, TP, current
from mesh.rules import auto_size
from models import fp8
from models.deferred_grads import SITES
from models.precision import Precision
from models.projection import Quantized, merge_over_tp, split_over_tp

# A layer's dense GEMMs by the weights each reads, merged where there are several (`Gemm.merged`): the projection
# sites', and Qwen2-MoE's shared expert's.
GROUPS = (*SITES.values(), ("w_shared_gate", "w_shared_up"), ("w_shared_down",))
EXPERTS = ("w_gate", "w_up", "w_down")  # an MoE layer's, [E, ...]: one GEMM each, per expert block
# name -> (e4m3 [L, ...] shaped like the weight, scales [L], or [L, blocks] for experts)
Stacks = dict[str, tuple[jax.Array, jax.Array]]
KEY = "fp8"  # where a pipeline carries the stacks beside a stage's weights (`with_stacks`)


def _as_matrix(name: str, w: jax.Array) -> jax.Array:
    """One layer's weight as its GEMM reads it, [D_in, D_out] (`DecoderLayer._attention` flattens the heads)."""
    return w.reshape(-1, w.shape[-1]) if name == "wo" else w.reshape(w.shape[0], -1)


def _group(names: tuple[str, ...], ws: list[jax.Array], tp: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """One layer's weights of one GEMM -> name: (e4m3 like the weight, the GEMM's scale)."""
    mats = [_as_matrix(n, w) for n, w in zip(names, ws)]
    merged = merge_over_tp(mats, tp) if len(mats) > 1 else mats[0]
    q, scale = fp8.quantize_weight(merged)
    parts = split_over_tp(q, [m.shape[-1] for m in mats], tp) if len(mats) > 1 else (q,)
    return {n: (part.reshape(w.shape), scale) for n, part, w in zip(names, parts, ws)}


def _expert_blocks(w: jax.Array, blocks: int) -> tuple[jax.Array, jax.Array]:
    """One layer's experts [E, ...] -> (e4m3 like them, [blocks] scales): one scale per ep device's experts, as
    `fp8.einsum` and `fp8.ragged_dot` take one for the experts they are handed."""
    def one(block):
        with jax.named_scope(fp8.WEIGHT_SCOPE):
            return fp8.quantize(block, fp8.E4M3, fp8.whole_amax(block, copies=(CP,)))
    q, scales = jax.vmap(one)(w.reshape(blocks, -1, *w.shape[1:]))
    return q.reshape(w.shape), scales


def quantize_layers(layers: dict[str, jax.Array], precision: Precision) -> Stacks:
    """The stacked layer weights [L, ...] (fp32 masters) -> per GEMM weight, its e4m3 stack and per-layer scales,
    as the layer reads it: cast to its module's dtype first, as the layer casts it."""
    mesh = current()
    tp, experts = auto_size(mesh, TP), "router" in layers
    out: Stacks = {}
    for names in GROUPS:
        if not all(n in layers for n in names) or (experts and names[0] in EXPERTS):
            continue
        ws = [lax.stop_gradient(layers[n]).astype(precision.weight_dtype(n)) for n in names]
        out.update(jax.vmap(lambda *one: _group(names, list(one), tp))(*ws))
    for name in EXPERTS if experts else ():
        w = lax.stop_gradient(layers[name]).astype(precision.weight_dtype(name))
        out[name] = jax.vmap(lambda one: _expert_blocks(one, auto_size(mesh, EP)))(w)
    return out


def expert_specs(spec: P) -> Quantized:
    """A `Quantized` expert weight's partition specs where its experts split as `spec`: the scales alike."""
    return Quantized(spec, spec, spec)


def attach(name: str, w: jax.Array, stacks: Stacks | None) -> jax.Array | Quantized:
    """One layer's weight `w` (in its module's dtype) as its GEMMs read it: with its fp8 form where the step made
    one (`stacks` holds this layer's slice), else as it is."""
    if not stacks or name not in stacks:
        return w
    q, scale = stacks[name]
    return Quantized(w, q, scale)


def with_stacks(layers: dict[str, Any], stacks: Stacks | None) -> dict[str, Any]:
    """A pipeline's stage weights with their fp8 stacks under `KEY`, so that the executor slices both by chunk and
    layer alike and the stage's VJP takes both as its weights (`pipeline/stage.py`)."""
    return layers if not stacks else {**layers, KEY: stacks}


def split_stacks(layers: dict[str, Any] | list[dict[str, Any]]) -> tuple[Any, Any]:
    """`with_stacks`' inverse, of stacked weights or a per-layer list: (the weights, their fp8 stacks or None).
    Gradients of the stacks are none (constants of the step), so a pipeline accumulates only the weights'."""
    if isinstance(layers, list):
        pairs = [split_stacks(one) for one in layers]
        return [w for w, _ in pairs], (None if pairs[0][1] is None else [q for _, q in pairs])
    return {k: a for k, a in layers.items() if k != KEY}, layers.get(KEY)


def stack_specs(stacks: Stacks, specs: dict[str, P]) -> Stacks:
    """One layer's partition specs of the stacks, from its weights' (`specs`): the fp8 values split as their weight,
    the scale whole."""
    return {name: (specs[name], P()) for name in stacks}
