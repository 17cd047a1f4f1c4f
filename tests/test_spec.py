"""The step specification is the one place a model-level choice lives: a toy precision policy (the
embedding's output rounded to bf16) is one subclass of `StepSpec`, and both gradient strategies,
the plain scan and the pipeline, run it unchanged."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh import MeshConfig, make_mesh
from models import llama
from models.config import LlamaConfig
from pjax.config import PipelineConfig, TrainConfig
from pjax.spec import StepSpec
from pjax.step import add_positions, build_trainer

CFG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
TC = TrainConfig(seq_len=8, batch_size=4, grad_accum=2, dtype="float32", steps=10, warmup_steps=2)


@dataclasses.dataclass(frozen=True)
class Bf16Embedding(StepSpec):
    """A per-module precision policy in miniature: the embedding's output rounded through bf16."""

    def embed(self, params, tokens):
        return super().embed(params, tokens).astype(jnp.bfloat16).astype(self.dtype)


def with_policy(spec: StepSpec) -> Bf16Embedding:
    return Bf16Embedding(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


@functools.cache
def losses(pp: int) -> tuple[float, float]:
    """(loss as built, loss under the policy) of one batch on 1 device or a 2-stage pipeline (its
    forwards-only evaluation table: the cheapest compile that runs the strategy's stages)."""
    mesh = make_mesh(MeshConfig(pp=pp), jax.devices()[:pp])
    trainer = build_trainer(mesh, CFG, TC, PipelineConfig())
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 2, 9)).astype(np.int32)
    batch = add_positions({"inputs": jnp.asarray(tokens[..., :-1]), "labels": jnp.asarray(tokens[..., 1:])})
    # With one chunk per device the pipeline's layer order is the model's.
    params = jax.device_put(llama.init_params(CFG, jax.random.key(0)), trainer.state_sharding.params)
    batch = jax.device_put(batch, trainer.batch_sharding)
    policy = dataclasses.replace(trainer.strategy, spec=with_policy(trainer.strategy.spec))
    with jax.set_mesh(mesh):
        return tuple(float(jax.jit(s.mean_loss)(params, batch)) for s in (trainer.strategy, policy))


def test_a_precision_policy_is_one_object_that_every_strategy_runs():
    plain, plain_policy = losses(1)
    piped, piped_policy = losses(2)
    # the policy changed the numbers a little (measured 6.1e-5 on a loss of 4.8)
    assert plain_policy != plain and abs(plain_policy - plain) < 1e-3
    assert piped == pytest.approx(plain, abs=1e-6)
    assert piped_policy == pytest.approx(plain_policy, abs=1e-6)  # the pipeline ran the same policy
