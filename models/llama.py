"""LLaMA in Flax (Linen): RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings.

Parameters declared once with logical axis names, layers stacked and scanned, 2-D activations [B*T, D],
a vocabulary padded to split over tp: ARCHITECTURE.md says why of each."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mesh.mesh import EP, current
from mesh.rules import by_shard_groups, constrain, flatten_tokens, manual_size, unflatten_tokens
from models import deferred_grads, fp8, fp8_weights
from models.bias_balance import BIAS
from models import sequence_parallel as seqpar
from models.attention import reference_attention
from models.config import LlamaConfig
from models.moe import Gemms, MoeConfig, RouterStats, moe_mlp
from models.precision import Precision
from models.projection import ProjectFn, plain_projection, select_projection
from models.remat import DEFAULT_NAMES, policy
from models.rope import rope, rope_inv_freq, rope_tables  # noqa: F401 (rope_inv_freq: llama's API)

Params = dict[str, Any]
SHARED = ("w_shared_gate", "w_shared_up", "w_shared_down")  # Qwen2-MoE's shared expert's GEMM weights

def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], init) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any = jnp.float32) -> jax.Array:
    """RMSNorm with statistics in `dtype`, cast back before the scale multiply (HF's order, which matters in bf16)."""
    x32 = x.astype(dtype)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm LLaMA block: x + attn(norm(x)), then h + mlp(norm(h)). x is [B*T, D]."""

    cfg: LlamaConfig
    precision: Precision = Precision()
    attention_fn: Callable[..., jax.Array] = reference_attention
    project_fn: ProjectFn = plain_projection
    moe: MoeConfig = MoeConfig()
    sequence_parallel: bool = False  # the residual stream split over tp too (models/sequence_parallel.py)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, tables: tuple[jax.Array, jax.Array],
                 taps: dict | None = None, quantized: fp8_weights.Stacks | None = None
                 ) -> tuple[jax.Array, RouterStats | None]:
        """positions [B, T], tables `rope_tables(positions)`, taps `deferred_grads`, `quantized` this layer's slice
        of `fp8_weights.quantize_layers` -> (x, MoE router stats or None)."""
        c = self.cfg
        d, h, kv, dh, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        normal, ones = nn.initializers.normal(c.initializer_range), nn.initializers.ones
        attn_norm = _param(self, "attn_norm", (d,), ("embed",), ones)
        wq = _param(self, "wq", (d, h, dh), ("embed", "heads", "head_dim"), normal)
        wk = _param(self, "wk", (d, kv, dh), ("embed", "kv_heads", "head_dim"), normal)
        wv = _param(self, "wv", (d, kv, dh), ("embed", "kv_heads", "head_dim"), normal)
        wo = _param(self, "wo", (h, dh, d), ("heads", "head_dim", "embed"), normal)
        mlp_norm = _param(self, "mlp_norm", (d,), ("embed",), ones)
        qk_norms = [_param(self, name, (dh,), ("head_dim",), ones) for name in ("q_norm", "k_norm")] if c.qk_norm else []
        biases = [_param(self, name, (n, dh), (axis, "head_dim"), nn.initializers.zeros)  # Qwen2's q/k/v biases
                  for name, n, axis in (("bq", h, "heads"), ("bk", kv, "kv_heads"), ("bv", kv, "kv_heads"))
                  ] if c.qkv_bias else []
        # MoE: in a shard_map manual over ep, this device's E/ep experts
        e = (c.num_local_experts // manual_size(current(), EP),) if c.num_local_experts else ()
        experts = ("experts",) if e else ()
        w_gate = _param(self, "w_gate", (*e, d, f), (*experts, "embed", "mlp"), normal)
        w_up = _param(self, "w_up", (*e, d, f), (*experts, "embed", "mlp"), normal)
        w_down = _param(self, "w_down", (*e, f, d), (*experts, "mlp", "embed"), normal)
        p = self.precision
        attn = lambda w: w.astype(p.attention)  # noqa: E731
        gemm_weight = lambda name, w: fp8_weights.attach(name, w.astype(p.weight_dtype(name)), quantized)  # noqa: E731
        sp = seqpar.active(self.sequence_parallel)
        column, row = self._projections(sp, taps)
        residual = ("sp_tokens" if sp else "tokens", "embed")
        x = constrain(x, residual)

        y = checkpoint_name(rms_norm(x, attn_norm, c.rms_norm_eps, p.norms), "attn_norm").astype(p.attention)
        o = self._attention(y, [gemm_weight(n, w) for n, w in zip(("wq", "wk", "wv", "wo"), (wq, wk, wv, wo))]
                            + [attn(w) for w in biases], [attn(w) for w in qk_norms],
                            positions, tables, column, row)
        x = x + constrain(o.astype(x.dtype), residual)

        y = checkpoint_name(rms_norm(x, mlp_norm, c.rms_norm_eps, p.norms), "mlp_norm").astype(p.mlp)
        if e:
            return self._moe(x, y, [w_gate, w_up, w_down], gemm_weight, sp, residual)
        gate, up = column(y, [gemm_weight("w_gate", w_gate), gemm_weight("w_up", w_up)], "gate_up")
        gate, up = checkpoint_name(gate, "gate_proj"), checkpoint_name(up, "up_proj")
        gated = constrain(jax.nn.silu(gate) * up, ("tokens", "mlp"))
        down = row(gated, gemm_weight("w_down", w_down), "down")
        return x + constrain(down.astype(x.dtype), residual), None

    def _moe(self, x: jax.Array, y: jax.Array, experts: list[jax.Array], gemm_weight: Callable, sp: bool,
             residual: tuple[str, str]) -> tuple[jax.Array, RouterStats | None]:
        """An MoE layer's MLP half on the normed residual y: x plus its routed experts (`experts`: w_gate, w_up,
        w_down) and Qwen2-MoE's shared expert; declares the router's and the shared expert's parameters."""
        c, p, d = self.cfg, self.precision, self.cfg.hidden_size
        normal = nn.initializers.normal(c.initializer_range)
        router = _param(self, "router", (d, c.num_local_experts), ("embed", None), normal)
        bias = ({BIAS: _param(self, BIAS, (c.num_local_experts,), (None,), nn.initializers.zeros)}
                if c.router_score == "sigmoid" else {})  # selects only, moved outside the optimizer
        fs = c.shared_expert_intermediate_size
        shared = [_param(self, name, shape, axes, normal) for name, shape, axes in (  # Qwen2-MoE's shared expert
            ("w_shared_gate", (d, fs), ("embed", "mlp")), ("w_shared_up", (d, fs), ("embed", "mlp")),
            ("w_shared_down", (fs, d), ("mlp", "embed")), ("shared_gate", (d, 1), ("embed", None)))] if fs else []
        if self.is_initializing():  # every parameter is declared; routing needs a real batch
            return x, None
        always = 0 if not shared else constrain(
            self._shared_expert(y, [gemm_weight(n, w) for n, w in zip(SHARED, shared[:3])]
                                + [shared[3].astype(p.mlp)], sp).astype(x.dtype), residual)
        weights = {"router": router.astype(p.router), **bias,
                   **{name: gemm_weight(name, w) for name, w in zip(fp8_weights.EXPERTS, experts)}}
        down, stats = self._experts(y, weights)
        return x + constrain(down.astype(x.dtype), residual) + always, stats

    def _attention(self, y: jax.Array, weights: list[jax.Array], qk_norms: list[jax.Array], positions: jax.Array,
                   tables: tuple[jax.Array, jax.Array], column: Callable, row: Callable) -> jax.Array:
        """Self-attention on the normed residual y [N, D]; `weights`: wq, wk, wv, wo (and Qwen2's q/k/v biases), in
        the attention dtype. q/k/v column-parallel, o row-parallel: XLA inserts the all-reduce after `wo`."""
        c, p = self.cfg, self.precision
        (b, t), dh = positions.shape, c.head_dim
        wq, wk, wv, wo, *biases = weights
        q, k, v = column(y, [w.reshape(w.shape[0], -1) for w in (wq, wk, wv)], "qkv")
        if biases:
            q, k, v = (a + bias.reshape(-1) for a, bias in zip((q, k, v), biases))
        q, k, v = (checkpoint_name(a, name) for a, name in zip((q, k, v), ("q_proj", "k_proj", "v_proj")))
        q, k, v = (unflatten_tokens(a.reshape(a.shape[0], -1, dh), b, t) for a in (q, k, v))
        if qk_norms:  # Qwen3: each head of q and k normalised before RoPE
            q, k = (rms_norm(a, scale, c.rms_norm_eps, p.norms) for a, scale in zip((q, k), qk_norms))
        q = constrain(q, ("batch", "sequence", "heads", "head_dim"))
        k = constrain(k, ("batch", "sequence", "kv_heads", "head_dim"))
        q, k = rope(q, tables), rope(k, tables)
        with jax.named_scope("attention"):
            o = flatten_tokens(self.attention_fn(q, k, v, positions, positions))
        o = checkpoint_name(o.reshape(o.shape[0], -1), "attn_out")
        return checkpoint_name(row(o, wo.reshape(-1, wo.shape[-1]), "o"), "o_proj")

    def _experts(self, y: jax.Array, weights: dict[str, jax.Array]) -> tuple[jax.Array, RouterStats]:
        """The routed experts on the normed residual y, which under sequence parallelism they see whole per (dp, cp)
        block: (their output [N, D], the router's statistics)."""
        c = self.cfg
        gemms = Gemms(fp8.einsum, fp8.ragged_dot) if self.precision.fp8 else Gemms()
        with jax.named_scope("experts"):
            return moe_mlp(constrain(y, ("tokens", "embed")), weights, gemms=gemms, top_k=c.num_experts_per_tok,
                           config=self.moe, normalize=c.norm_topk_prob, score=c.router_score)

    def _shared_expert(self, y: jax.Array, weights: list[jax.Array], sp: bool) -> jax.Array:
        """Qwen2-MoE's shared expert on the normed residual y: an MLP every token runs, times a sigmoid gate of y,
        in the residual's layout. Its GEMMs keep their weight gradients in B under zero-bubble, as the experts do."""
        w_gate, w_up, w_down, w_g = weights
        column, row = self._projections(sp, None)
        gate, up = column(y, [w_gate, w_up], "shared_gate_up")
        down = row(jax.nn.silu(gate) * up, w_down, "shared_down")
        with jax.named_scope("shared_gate"):
            g = jax.nn.sigmoid(jnp.einsum("nd,do->no", y, w_g, preferred_element_type=jnp.float32))
        return (g * down).astype(y.dtype)

    def _projections(self, sp: bool, taps: dict | None) -> tuple[Callable, Callable]:
        """(column, row) matmuls by site, in the form sequence parallelism and zero-bubble taps ask for, each of
        their GEMMs by `fp8.gemm`: fp8 under `precision.fp8`."""
        column, row = self._forms(sp, taps, fp8.gemm(self.precision.fp8))
        return _named(column), _named(row)

    def _forms(self, sp: bool, taps: dict | None, gemm) -> tuple[Callable, Callable]:
        if sp and taps is not None:
            return (lambda y, ws, site: deferred_grads.tapped_column(y, ws, taps[site], gemm),
                    lambda y, w, site: deferred_grads.tapped_row(y, w, taps[site], gemm))
        if sp:
            return (lambda y, ws, site: seqpar.column(y, ws, None, gemm)), (lambda y, w, site: seqpar.row(y, w, gemm))
        column = ((lambda y, ws, site: self.project_fn(y, ws, gemm)) if taps is None
                  else (lambda y, ws, site: deferred_grads.tapped_projection(y, ws, taps[site], gemm)))
        return column, (lambda y, w, site: column(y, [w], site)[0])


def _named(form: Callable) -> Callable:
    """`form` under a named scope of its site ('qkv', 'o', 'gate_up', 'down'): a profile, and the compiled
    program's op names, say which projection each GEMM, forward or backward, belongs to."""
    def named(y, ws, site):
        with jax.named_scope(site):
            return form(y, ws, site)
    return named


class Embed(nn.Module):
    """Token embedding, vocab-parallel: the table's vocabulary dimension is split over tp."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        table = _param(self, "embedding", (c.padded_vocab_size, c.hidden_size), ("vocab", "embed"),
                       nn.initializers.normal(c.initializer_range))
        return jnp.take(table, tokens, axis=0)


class Head(nn.Module):
    """Final RMSNorm scale and the untied output projection [D, V] (vocab-parallel)."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> None:
        c = self.cfg
        _param(self, "scale", (c.hidden_size,), ("embed",), nn.initializers.ones)
        if not c.tie_word_embeddings:
            _param(self, "kernel", (c.hidden_size, c.padded_vocab_size), ("embed", "vocab"),
                   nn.initializers.normal(c.initializer_range))


def _boxed_init(cfg: LlamaConfig, rng: jax.Array) -> Params:
    """All parameters as Flax `LogicallyPartitioned` boxes (values + logical axis names)."""
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    tokens = jnp.zeros((1, 1), jnp.int32)
    x, pos = jnp.zeros((1, cfg.hidden_size)), jnp.zeros((1, 1), jnp.int32)
    layer = DecoderLayer(cfg)
    # vmap stacks each parameter along a new leading dim; the box keeps the per-layer names.
    tables = rope_tables(pos, cfg)
    init_one = lambda k: layer.init(k, x, pos, tables)["params"]
    stacked = jax.vmap(init_one)(jax.random.split(k_layers, cfg.num_hidden_layers))
    stacked = jax.tree.map(lambda b: b.replace(names=("layers",) + b.names), stacked,
                           is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))
    head = Head(cfg).init(k_head, x)["params"]
    params = {
        "embed": Embed(cfg).init(k_embed, tokens)["params"],
        "layers": stacked,
        "final_norm": {"scale": head["scale"]},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": head["kernel"]}
    return params


def param_logical_axes(cfg: LlamaConfig) -> Params:
    """The logical axis names of every parameter, as a tree shaped like the parameters."""
    boxed = jax.eval_shape(lambda: _boxed_init(cfg, jax.random.key(0)))
    return jax.tree.map(lambda b: b.names, boxed, is_leaf=lambda b: isinstance(b, nn.LogicallyPartitioned))


def init_params(cfg: LlamaConfig, rng: jax.Array) -> Params:
    """Random fp32 parameters (HF's init); under `jax.jit(..., out_shardings=...)` created sharded."""
    return nn.meta.unbox(_boxed_init(cfg, rng))


def embed(params: Params, tokens: jax.Array, cfg: LlamaConfig, dtype=jnp.float32,
          sequence_parallel: bool = False) -> jax.Array:
    """Token ids [B, T] -> 2-D activations [B*T, D] in the compute dtype (tokens over tp too under SP)."""
    ids = flatten_tokens(tokens)
    if seqpar.active(sequence_parallel):
        return constrain(seqpar.lookup(params["embed"]["embedding"], ids, dtype), ("sp_tokens", "embed"))
    x = Embed(cfg).apply({"params": params["embed"]}, ids).astype(dtype)
    return constrain(by_shard_groups(x), ("tokens", "embed"))


def decoder_layer(cfg: LlamaConfig, *, precision: Precision = Precision(), remat: str = "none",
                  attention_fn: Callable[..., jax.Array] = reference_attention, moe: MoeConfig = MoeConfig(),
                  sequence_parallel: bool = False) -> DecoderLayer:
    """The decoder layer module with its choices bound (the matmul form follows `remat`: `select_projection`)."""
    return DecoderLayer(cfg, precision=precision, attention_fn=attention_fn, project_fn=select_projection(remat), moe=moe,
                        sequence_parallel=sequence_parallel)


def apply_layers(layer: DecoderLayer, layer_params: Params, x: jax.Array, positions: jax.Array, *,
                 remat: str = "none", remat_names: Sequence[str] = DEFAULT_NAMES, scan: bool = True,
                 taps: dict | None = None, quantized: fp8_weights.Stacks | None = None
                 ) -> tuple[jax.Array, RouterStats | None]:
    """A stack of `layer`s (the model or a pipeline stage) -> (output, MoE router statistics summed). Unrolled,
    `layer_params` and `taps` may be per-layer lists: a stage slices them outside its VJP, keeping no slices.
    `quantized`: the stack's weights in fp8, made once per step (`fp8_weights.quantize_layers`)."""
    tables = rope_tables(positions, layer.cfg)

    def body(h, p_taps):
        p, t, q = p_taps
        return layer.apply({"params": p}, h, positions, tables, t, q)

    if remat != "none":
        body = jax.checkpoint(body, policy=policy(remat, remat_names), prevent_cse=not scan)
    if scan:
        x, stats = jax.lax.scan(body, x, (layer_params, taps, quantized))
        return x, jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)
    layer_i = lambda tree, i: tree[i] if isinstance(tree, list) else jax.tree.map(lambda a: a[i], tree)
    n = len(layer_params) if isinstance(layer_params, list) else jax.tree.leaves(layer_params)[0].shape[0]
    stats = []
    for i in range(n):
        x, s = body(x, (layer_i(layer_params, i), layer_i(taps, i), layer_i(quantized, i)))
        stats.append(s)
    return x, (jax.tree.map(lambda *s: sum(s), *stats) if layer.cfg.num_local_experts else None)


def run_layers(layer_params: Params, x: jax.Array, positions: jax.Array, cfg: LlamaConfig, *,
               dtype=jnp.float32, remat: str = "none", remat_names: Sequence[str] = DEFAULT_NAMES,
               scan: bool = True, attention_fn: Callable[..., jax.Array] = reference_attention,
               moe: MoeConfig = MoeConfig(), sequence_parallel: bool = False, taps: dict | None = None
               ) -> tuple[jax.Array, RouterStats | None]:
    """`apply_layers` of the `decoder_layer` these options make (the functional form, for tests and notebooks)."""
    layer = decoder_layer(cfg, precision=Precision.uniform(dtype), remat=remat, attention_fn=attention_fn, moe=moe,
                          sequence_parallel=sequence_parallel)
    return apply_layers(layer, layer_params, x, positions, remat=remat, remat_names=remat_names, scan=scan, taps=taps)


def final_hidden(params: Params, tokens: jax.Array, positions: jax.Array, cfg: LlamaConfig, **kw
                 ) -> tuple[jax.Array, RouterStats | None]:
    """Embedding, decoder layers and final norm: [B, T] ids -> [B*T, D] hidden states, router statistics."""
    x0 = embed(params, tokens, cfg, kw.get("dtype", jnp.float32), kw.get("sequence_parallel", False))
    x, stats = run_layers(params["layers"], x0, positions, cfg, **kw)
    return rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps), stats


def output_kernel(params: Params, cfg: LlamaConfig) -> jax.Array:
    """The [D, Vp] output projection (tied: the embedding's transpose); mask its logits with `mask_padded_vocab`."""
    if cfg.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


def mask_padded_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """Logits [..., Vp] with the padded entries at -inf, on a vocab-parallel slice too (XLA offsets the iota per shard)."""
    if logits.shape[-1] == vocab_size:
        return logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def logits(params: Params, tokens: jax.Array, cfg: LlamaConfig, positions: jax.Array | None = None,
           **kw) -> jax.Array:
    """Full-vocabulary logits [B, T, V] in fp32, the padding cut off (evaluation and tests)."""
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, _ = final_hidden(params, tokens, positions, cfg, **kw)
    out = jnp.einsum("nd,dv->nv", h, output_kernel(params, cfg).astype(h.dtype), preferred_element_type=jnp.float32)
    return unflatten_tokens(out[:, :cfg.vocab_size], b, t)
