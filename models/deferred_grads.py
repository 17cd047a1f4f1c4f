"""Weight gradients taken out of the backward, for zero-bubble pipelines' W items (ARCHITECTURE.md, "Zero-bubble:
B and W as separate items"): a tapped projection's backward hands (x, g) to a zero `tap` input in place of dW,
and `tap_weight_grads` multiplies them out."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from models import sequence_parallel as seqpar
from models.config import LlamaConfig
from models.precision import Precision
from models.projection import PLAIN, Gemm, input_grad, plain_projection, weight_grads, weight_products

Tap = tuple[jax.Array, tuple[jax.Array, ...]]  # (like x [N, D_in], like each output [N, F_i])
SITES = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "gate_up": ("w_gate", "w_up"), "down": ("w_down",)}
ROW_SITES = ("o", "down")


def _tapped(forward: Callable, input_grad_and_tap: Callable) -> Callable:
    """`forward(x, ws, gemm)` with an ignored tap input whose cotangent is what W needs; zero weight gradients."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def tapped(x, ws, tap, gemm: Gemm = PLAIN):
        del tap
        return forward(x, ws, gemm)

    def fwd(x, ws, tap, gemm):
        del tap
        return forward(x, ws, gemm), (x, ws)

    def bwd(gemm, res, gs):
        x, ws = res
        d_x, to_w = input_grad_and_tap(x, ws, gs, gemm)
        return d_x, jax.tree.map(jnp.zeros_like, ws), to_w

    tapped.defvjp(fwd, bwd)
    return tapped


tapped_projection = _tapped(plain_projection, lambda x, ws, gs, gemm: (input_grad(x, gs, ws, gemm), (x, tuple(gs))))


def _column_input_grad(x, ws, gs, gemm):
    gs = tuple(g.astype(x.dtype) for g in gs)
    return seqpar.reduce_scatter_product(gs, ws, x.dtype, gemm), (x, gs)


def _row_input_grad(x, w, g, gemm):
    g = g.astype(x.dtype)
    return gemm.input_grad(seqpar.gather(g), w).astype(x.dtype), (x, (g,))


# Under SP the tap holds the operand split over tp along the tokens: x for column, g for row.
tapped_column = _tapped(lambda x, ws, gemm: seqpar.column(x, ws, None, gemm), _column_input_grad)
tapped_row = _tapped(seqpar.row, _row_input_grad)


def layer_taps(cfg: LlamaConfig, layers: int, tokens: int, precision: Precision) -> dict[str, Tap]:
    """Zero taps for `layers` stacked layers of `tokens` tokens: per site, [layers, tokens, width] in its module's dtype.
    An MoE layer's experts are no tapped projection (their gradients stay in B, beside the router's): attention only."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    widths = {"qkv": (d, (q, kv, kv)), "o": (q, (d,)), "gate_up": (d, (f, f)), "down": (f, (d,))}
    dtypes = {"qkv": precision.attention, "o": precision.attention, "gate_up": precision.mlp, "down": precision.mlp}
    z = lambda w, site: jnp.zeros((layers, tokens, w), dtypes[site])
    sites = ("qkv", "o") if cfg.num_local_experts else tuple(widths)
    return {site: (z(x, site), tuple(z(w, site) for w in outs)) for site, (x, outs) in widths.items() if site in sites}


def site_weight_grads(site: str, x: jax.Array, gs: Sequence[jax.Array], sequence_parallel: bool = False,
                      gemm: Gemm = PLAIN) -> tuple[jax.Array, ...]:
    """One layer's fp32 dW_i = x^T g_i at `site` from its tap's cotangent; under SP the split operand is gathered."""
    f32 = [jnp.zeros((), jnp.float32)] * len(gs)  # weight_grads casts each dW to its w's dtype
    if not sequence_parallel:
        return weight_grads(x, gs, f32, gemm)
    if site in ROW_SITES:
        return weight_grads(x, [seqpar.gather(gs[0])], f32, gemm)
    xt = seqpar.gather_transposed(x)
    return tuple(dw.astype(jnp.float32) for dw in weight_products(xt, gs, gemm))


def tap_weight_grads(taps: dict[str, Tap] | list[dict[str, Tap]], w: Any, sequence_parallel: bool = False,
                     gemm: Gemm = PLAIN) -> dict[str, jax.Array]:
    """W: the tapped projections' fp32 gradients shaped like the stacked `w`, from taps stacked per layer or a
    per-layer list (the sites `layer_taps` gave)."""
    out, present = {}, taps[0] if isinstance(taps, list) else taps
    for site, names in ((site, names) for site, names in SITES.items() if site in present):
        one = lambda x, gs: site_weight_grads(site, x, gs, sequence_parallel, gemm)
        with jax.named_scope(site):  # the layer's own scope names (models/llama.py: `_named`)
            if isinstance(taps, list):
                dws = [jnp.stack(d) for d in zip(*[one(*t[site]) for t in taps])]
            elif sequence_parallel:  # the gathers are shard_maps: one layer after another
                dws = jax.lax.map(lambda xg: one(*xg), taps[site])
            else:
                dws = jax.vmap(one)(*taps[site])
        out.update({n: dw.reshape(w[n].shape) for n, dw in zip(names, dws)})
    return out
