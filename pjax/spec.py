"""The step specification (ARCHITECTURE.md, "One step specification, strategies around it"): a new
model-level choice is a field here, not an argument threaded through the strategies."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mesh.rules import flatten_tokens
from models import fp8, fp8_weights, llama
from models import sequence_parallel as seqpar
from models.attention import reference_attention, select_attention
from models.config import LlamaConfig
from models.moe import MoeConfig, RouterStats, router_loss
from models.precision import Precision, PrecisionConfig
from models.remat import DEFAULT_NAMES
from pjax.config import TrainConfig
from pjax.parallel.tensor_parallel import vocab_parallel_cross_entropy

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The LLaMA as a step runs it: `embed -> layers -> head`, every model-level choice bound."""

    cfg: LlamaConfig
    precision: Precision = Precision()
    attention_fn: Callable = reference_attention
    remat: str = "none"
    remat_names: tuple[str, ...] = DEFAULT_NAMES
    scan: bool = True
    moe: MoeConfig = MoeConfig()
    sequence_parallel: bool = False
    loss_chunk: int = 0
    # fp8 weights quantized once per step (models/fp8_weights.py); off where a step is differentiated through
    # (MAML), whose second derivative reaches a weight through the fp8 form its GEMM makes of it.
    quantize_once: bool = True

    @classmethod
    def build(cls, cfg: LlamaConfig, tc: TrainConfig, moe: MoeConfig = MoeConfig(),
              attention_fn: Callable | None = None, precision: Precision | None = None) -> StepSpec:
        """`attention_fn` replaces train.attention's kernel (context parallelism), `precision` train.dtype's policy."""
        precision = precision or PrecisionConfig().resolve(tc.dtype)
        if precision.fp8:
            fp8.check()
        return cls(cfg, precision, attention_fn or select_attention(tc.attention), tc.remat,
                   tc.saved_names, tc.scan_layers, moe, tc.sequence_parallel, tc.loss_chunk)

    @property
    def dtype(self) -> Any:
        """The residual stream's dtype: what each layer takes and returns."""
        return self.precision.embedding

    @property
    def tokens(self) -> str:
        """The residual stream's token axis: 'sp_tokens' (split over tp too) under sequence parallelism."""
        return seqpar.residual_axis(self.sequence_parallel)

    def embed(self, params: Any, tokens: jax.Array) -> jax.Array:
        """Token ids [B, T] -> x [B*T, D] in the compute dtype (reads params['embed'])."""
        return llama.embed(params, tokens, self.cfg, self.dtype, self.sequence_parallel)

    def layers(self, layer_params: Any, x: jax.Array, positions: jax.Array, taps: Any = None,
               quantized: fp8_weights.Stacks | None = None) -> tuple[jax.Array, RouterStats | None]:
        """A stack of decoder layers (the model's or a stage's): x and their summed router statistics."""
        return llama.apply_layers(self.decoder_layer(), layer_params, x, positions, remat=self.remat,
                                  remat_names=self.remat_names, scan=self.scan, taps=taps, quantized=quantized)

    def decoder_layer(self) -> llama.DecoderLayer:
        """The decoder layer module with this spec's choices (dtype, attention, matmul form, MoE, sequence parallelism)."""
        return llama.decoder_layer(self.cfg, precision=self.precision, remat=self.remat, attention_fn=self.attention_fn,
                                   moe=self.moe, sequence_parallel=self.sequence_parallel)

    def no_stats(self) -> RouterStats | tuple:
        """Router statistics before the first layer: zeros, or () for a dense model."""
        e = self.cfg.num_local_experts
        if not e:
            return ()
        return RouterStats(*(jnp.zeros(shape, jnp.float32) for shape in [(), (e,), (e,), (), ()]))

    def head(self, params: Any, x: jax.Array, stats: Any, labels: jax.Array
             ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
        """Summed loss of the last layer's output and (token count, router metrics); MoE router losses
        are added times the count, so dividing by it gives mean cross-entropy + coef * each."""
        h = self.final_norm(params, x)
        loss, count = vocab_parallel_cross_entropy(h, llama.output_kernel(params, self.cfg), flatten_tokens(labels),
                                                   self.loss_chunk, self.cfg.vocab_size, self.sequence_parallel)
        if not self.cfg.num_local_experts:
            return loss, (count, {})
        extra, router = router_loss(stats, count, self.cfg)
        return loss + extra, (count, router)

    def head_keys(self) -> tuple[str, ...]:
        """The parameters `head` reads besides `x`."""
        return ("final_norm", "embed" if self.cfg.tie_word_embeddings else "lm_head")

    def loss_sum(self, params: Any, micro: Batch, quantized: fp8_weights.Stacks | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
        """Summed loss of one micro-batch ({'inputs', 'labels', 'positions'}: [B, T]) and (count, router metrics);
        `quantized`: the layers' fp8 weights of this step (`quantize_weights`), else each GEMM quantizes its own."""
        x, stats = self.layers(params["layers"], self.embed(params, micro["inputs"]), micro["positions"],
                               quantized=quantized)
        return self.head(params, x, stats, micro["labels"])

    def hidden(self, params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """The final-normed hidden states [B*T, D] (evaluation, generation)."""
        x, _ = self.layers(params["layers"], self.embed(params, tokens), positions)
        return self.final_norm(params, x)

    def quantize_weights(self, layer_params: Any) -> fp8_weights.Stacks | None:
        """Under `precision.fp8`, the stacked layer weights' fp8 forms for a step's micro-batches to share."""
        if not (self.precision.fp8 and self.quantize_once):
            return None
        return fp8_weights.quantize_layers(layer_params, self.precision)

    def final_norm(self, params: Any, x: jax.Array) -> jax.Array:
        """The final RMSNorm, in the output layer's dtype."""
        p = self.precision
        return llama.rms_norm(x, params["final_norm"]["scale"], self.cfg.rms_norm_eps, p.norms).astype(p.output)


def accumulate(params: Any, batch: Batch, spec: StepSpec, pin: Callable[[Any], Any] = lambda g: g
               ) -> tuple[jax.Array, jax.Array, Any, dict[str, jax.Array]]:
    """Summed loss, token count and gradients (in `precision.grad_accum`), mean MoE router metrics: a micro-batch scan.
    fp8 weights are quantized here, once, for every micro-batch (models/fp8_weights.py)."""
    quantized = spec.quantize_weights(params["layers"])
    grad_fn = jax.value_and_grad(lambda p, micro: spec.loss_sum(p, micro, quantized), has_aux=True)

    def micro_step(carry, micro):
        totals, grads_acc = carry
        # The micro-batch waits for the last one's totals, a loop-carried array that is not a scalar: else XLA:GPU's
        # collective pipeliner may hoist the next micro-batch's whole forward into this iteration to feed an
        # all-gather (sequence parallelism's before the head), and run it again for its residuals (ARCHITECTURE.md,
        # "One forward per micro-batch").
        micro, totals = jax.lax.optimization_barrier((micro, totals))
        (loss, (count, router)), grads = grad_fn(params, micro)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, pin(grads))
        return (totals + jnp.stack([loss, count]).astype(totals.dtype), grads_acc), router

    # zeros_like keeps the parameters' varying-ness inside a shard_map (scan carries must match).
    zeros = pin(jax.tree.map(lambda p: jnp.zeros_like(p, spec.precision.grad_accum), params))
    totals = jnp.zeros_like(jax.tree.leaves(params)[0], jnp.float32, shape=(2,))  # (loss, token count)
    (totals, grads), router = jax.lax.scan(micro_step, (totals, zeros), batch)
    loss, count = totals[0], totals[1]
    return loss, count, grads, jax.tree.map(lambda m: jnp.mean(m, axis=0), router)
