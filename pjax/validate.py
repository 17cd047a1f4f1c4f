"""Whether a run splits over its mesh: one pass over the rules each part of pjax contributes.

A rule takes the run (`Run`) and raises the one-line ConfigError that says what to change; each lives next
to what it protects, and a new strategy adds its rule to `RULES`. Values wrong whatever the mesh are
refused earlier, by the config dataclasses' `__post_init__`."""
from __future__ import annotations

from typing import NamedTuple

from mesh.backend import target_backend
from mesh.errors import ConfigError
from mesh.mesh import MeshConfig
from mesh.validate import validate_batch, validate_model
from models import sequence_parallel
from models.config import LlamaConfig
from models.moe import MoeConfig
from models.precision import PrecisionConfig
from pjax.config import MetaConfig, TrainConfig
from pjax.parallel import compression, data_parallel, meta, outer, streaming
from pjax.parallel.context import strategy as context_strategy
from pjax.parallel.context.strategy import ContextConfig
from pjax.parallel.pipeline import table as pipeline_table
from pjax.parallel.pipeline.table import PipelineConfig


class Run(NamedTuple):
    """What the rules read: the mesh and the config sections a layout depends on."""

    mesh: MeshConfig
    model: LlamaConfig
    train: TrainConfig
    pipeline: PipelineConfig = PipelineConfig()
    context: ContextConfig = ContextConfig()
    precision: PrecisionConfig = PrecisionConfig()
    meta: MetaConfig = MetaConfig()
    moe: MoeConfig = MoeConfig()


def validate_layout(mesh: MeshConfig, cfg: LlamaConfig, zero: int, zero_shard: int = 0) -> None:
    """A one-line ConfigError unless the model (experts included) splits over `mesh` with ZeRO stage `zero` over
    groups of `zero_shard` data replicas (0: all)."""
    validate_model(mesh, num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                   num_kv_heads=cfg.num_key_value_heads, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, zero=zero,
                   vocab_multiple=cfg.make_vocab_size_divisible_by, num_experts=cfg.num_local_experts,
                   zero_shard=zero_shard)


def model_splits(run: Run) -> None:
    validate_layout(run.mesh, run.model, run.train.zero, run.train.zero_shard)


def batch_splits(run: Run) -> None:
    validate_batch(run.mesh, batch_size=run.train.batch_size, grad_accum=run.train.grad_accum,
                   seq_len=run.train.seq_len)


def accumulator_compiles(run: Run) -> None:
    """A bf16 gradient accumulator on more than one device aborts XLA:CPU (the HLO check failure of
    `pipeline.table.check_xla_cpu`): one line instead."""
    if target_backend() != "cpu" or run.precision.resolve(run.train.dtype).grad_accum.name != "bfloat16":
        return
    if any(size != 1 for size in run.mesh.shape):
        raise ConfigError("precision.grad_accum=bfloat16 on more than one device crashes XLA:CPU; on CPU keep "
                          "precision.grad_accum=float32, or train on one device.")


RULES = (data_parallel.check_run, model_splits, batch_splits, accumulator_compiles, pipeline_table.check_run,
         context_strategy.check_run, sequence_parallel.check_run, compression.check_run, outer.check_run,
         streaming.check_run, meta.check_run)


def validate_run(mc: MeshConfig, cfg: LlamaConfig, tc: TrainConfig, pipeline: PipelineConfig = PipelineConfig(),
                 context: ContextConfig = ContextConfig(), precision: PrecisionConfig = PrecisionConfig(),
                 meta_cfg: MetaConfig = MetaConfig(), moe: MoeConfig = MoeConfig()) -> None:
    """A one-line ConfigError, from the first of `RULES` that fails, unless the run splits over `mc`."""
    run = Run(mc, cfg, tc, pipeline, context, precision, meta_cfg, moe)
    for rule in RULES:
        rule(run)
