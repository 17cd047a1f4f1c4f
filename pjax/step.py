"""One training step: loss, gradient accumulation over micro-batches, AdamW update, in one `jax.jit`. The loss
is the mean over the global batch's tokens on any layout (ARCHITECTURE.md, "Gradient accumulation inside the step")."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh import hosts
from mesh.backend import on_target
from mesh.errors import ConfigError, listed
from mesh.mesh import CP, DATA, DP, MeshConfig, PP, current, make_mesh
from models import bias_balance, llama
from models.attention import select_attention
from models.config import LlamaConfig, shape_keys
from models.moe import MoeConfig
from models.precision import PrecisionConfig
from pjax.config import Config, ContextConfig, MetaConfig, PipelineConfig, TrainConfig
from pjax import xla_options
from pjax.divergence import keep_if_finite
from pjax.optim import lr_schedule, make_optimizer, schedule_count
from pjax.parallel import data_parallel, feedback, group_zero, meta, outer, streaming
from pjax.parallel.context import strategy as context_strategy
from pjax.parallel.pipeline import layout as pipeline_layout
from pjax.parallel.pipeline.step import Pipelined
from pjax.spec import StepSpec, accumulate
from pjax.validate import validate_run

Batch = dict[str, jax.Array]


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any
    residual: Any = None  # error feedback's state, with train.grad_compression (`pjax.parallel.feedback`)
    local: Any = None  # DiLoCo's groups: their parameters and inner optimizer state (`pjax.parallel.outer`)


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """The step's gradients with pp = 1: micro-batches accumulated by a scan, reduced once per step
    (`data_parallel.reduce_once`), or under ZeRO-3 pinned to their dp slices as they accumulate."""

    spec: StepSpec
    zero: int = 0
    grad_sharding: Any = None
    compression: str = "none"  # train.grad_compression: the once-per-step reduction's payload

    def loss_and_grads(self, params: Any, batch: Batch) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
        """Mean token loss of the global batch, its gradient, and the router metrics (MoE; else {})."""
        local = functools.partial(accumulate, spec=self.spec)
        if data_parallel.can_reduce_once(current(), self.zero):
            return data_parallel.reduce_once(local, params, batch, self.spec.cfg, self.zero)

        def pin(g):
            return g if self.grad_sharding is None else jax.lax.with_sharding_constraint(g, self.grad_sharding)

        loss, count, grads, router = local(params, batch, pin=pin)
        return loss / count, jax.tree.map(lambda g: g / count, grads), router

    def compressed_loss_and_grads(self, params: Any, batch: Batch, residual: Any) -> tuple[Any, ...]:
        """`loss_and_grads` with the reduction's payload compressed, and the new error-feedback residual fourth."""
        local = functools.partial(accumulate, spec=self.spec)
        return data_parallel.reduce_once(local, params, batch, self.spec.cfg, self.zero, self.compression, residual)

    def per_replica_loss_and_grads(self, stacked_params: Any, batch: Batch, group_size: int = 1,
                                   scatter: bool = False) -> tuple[jax.Array, Any, dict]:
        """The global batch's mean loss, each dp replica's mean gradient on its group's rows from its own
        [replicas, ...] parameters (`data_parallel.per_replica`; with `scatter`, its chunk of the group's), and
        the groups' mean router metrics (MoE; else {})."""
        local = functools.partial(accumulate, spec=self.spec)
        return data_parallel.per_replica(local, stacked_params, batch, self.spec.cfg, group_size, scatter)

    def mean_loss(self, params: Any, batch: Batch) -> jax.Array:
        """Mean token loss (with MoE router losses) of a batch without gradients."""
        def micro_step(carry, micro):
            loss, (count, _) = self.spec.loss_sum(params, micro)
            return (carry[0] + loss, carry[1] + count), None

        (loss, count), _ = jax.lax.scan(micro_step, (jnp.zeros(()), jnp.zeros(())), batch)
        return loss / count


def train_step(state: TrainState, batch: Batch, *, strategy: Any, optimizer: optax.GradientTransformation,
               tc: TrainConfig, bias_rate: float = 0.0) -> tuple[TrainState, dict]:
    """One optimizer step on `strategy`'s gradients: new state, {loss, grad_norm, lr, finite} + MoE router metrics;
    sigmoid routing's selection biases move by `bias_rate` against their layers' loads (`models/bias_balance.py`)."""
    loss, grads, router, residual = _gradients(state, batch, strategy, tc)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # a bf16 accumulator's sum, for fp32 masters
    loads, grads = bias_balance.split_loads(grads)
    grad_norm = optax.tree.norm(grads)
    lr = lr_schedule(tc)(schedule_count(state.opt_state))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = bias_balance.moved(optax.apply_updates(state.params, updates), state.params, loads, bias_rate)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if tc.on_nonfinite == "skip":
        params, opt_state, residual = keep_if_finite(finite, (params, opt_state, residual),
                                                     (state.params, state.opt_state, state.residual))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite, **router}
    return TrainState(state.step + 1, params, opt_state, residual), metrics


def _gradients(state: TrainState, batch: Batch, strategy: Any, tc: TrainConfig) -> tuple[Any, ...]:
    """(loss, grads, router metrics, feedback state): reduced exactly, or compressed with `state.residual`; during
    PowerSGD's first `train.powersgd_start` steps exactly, the state kept as it is (both branches compiled)."""
    if state.residual is None:
        return (*strategy.loss_and_grads(state.params, batch), None)

    def compressed():
        loss, grads, router, residual = strategy.compressed_loss_and_grads(state.params, batch, state.residual)
        return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), router, residual

    if not tc.powersgd_start:
        return compressed()

    def exact():
        loss, grads, router = strategy.loss_and_grads(state.params, batch)
        return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), router, state.residual

    return jax.lax.cond(state.step < tc.powersgd_start, exact, compressed)


def add_positions(batch: Batch) -> Batch:
    """Fill in 'positions' (0..T-1 per row) when a batch has none."""
    if "positions" in batch:
        return batch
    k, b, t = batch["inputs"].shape
    return {**batch, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (k, b, t))}


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The compiled pieces of a run on one mesh: shardings, `init` and the jitted `step`."""

    mesh: Mesh
    cfg: LlamaConfig
    tc: TrainConfig
    optimizer: optax.GradientTransformation
    state_sharding: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, Batch], tuple[TrainState, dict]]
    grads: Callable[[Any, Batch], tuple[jax.Array, Any]]
    loss: Callable[[Any, Batch], jax.Array]
    strategy: Any = None  # `Accumulation`, or `pipeline.step.Pipelined` (pp > 1)
    xla_options: dict | None = None  # the compile options of its jitted functions (`pjax.xla_options`)
    pipeline: PipelineConfig | None = None  # set when pp > 1
    diloco: outer.DiLoCo | None = None  # set with train.local_steps > 0; `optimizer` is then the outer one
    learner: meta.Meta | None = None  # set with a meta.algorithm; `optimizer` is then the meta-parameters' one

    def abstract_state(self) -> TrainState:
        """The state as sharded shapes: a restore target, or an input to compile from without allocating."""
        key = jax.random.key(0)  # made outside the mesh: a compile-only GPU mesh runs no eager op
        with jax.set_mesh(self.mesh):  # DiLoCo under ZeRO cuts the groups' chunks in a shard_map
            shapes = jax.eval_shape(self.init.jitted, key)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_sharding)

    def abstract_batch(self, seq_len: int | None = None) -> Batch:
        """A global batch as sharded shapes: int32 [grad_accum, batch_size // grad_accum, seq_len]; at a shorter
        `seq_len` (a curriculum's), seq_len / that times the rows: the same tokens."""
        seq_len = self.tc.seq_len if seq_len is None else seq_len
        rows = self.tc.batch_size * (self.tc.seq_len // seq_len) // self.tc.grad_accum
        shape = (self.tc.grad_accum, rows, seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
                for k in ("inputs", "labels", "positions")}

    def compile_step(self, state: Any = None, batch: Any = None) -> Any:
        """The step compiled ahead of time (from shapes unless arrays are given)."""
        state = self.abstract_state() if state is None else state
        batch = self.abstract_batch() if batch is None else batch
        with jax.set_mesh(self.mesh), on_target():  # a compile-only GPU's kernels lower for it
            return self.step.jitted.lower(state, batch).compile()


def build_trainer(mesh: Mesh, cfg: LlamaConfig, tc: TrainConfig, pipeline: PipelineConfig | None = None,
                  moe: MoeConfig | None = None, context: ContextConfig | None = None,
                  precision: PrecisionConfig = PrecisionConfig(), meta_cfg: MetaConfig = MetaConfig()) -> Trainer:
    """Validate the layout, then build sharded `init(rng)`, `step(state, batch)` and `grads(params, batch)`."""
    pipeline, moe, context = pipeline or PipelineConfig(), moe or MoeConfig(), context or ContextConfig()
    mc = _validated(mesh, cfg, tc, pipeline, context, precision, meta_cfg, moe)
    policy = precision.resolve(tc.dtype)
    inner = make_optimizer(tc, policy.optimizer_state, clipped_before=group_zero.sharded(tc, mesh.shape[DP]))
    optimizer = outer.outer_optimizer(tc) if tc.local_steps else inner
    if meta_cfg.algorithm:
        optimizer = meta.meta_optimizer(meta_cfg, tc, inner)
    p_sharding = data_parallel.param_shardings(mesh, cfg, tc.zero)
    g_sharding = data_parallel.grad_shardings(mesh, cfg, tc.zero)
    params_shape = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
    o_sharding = data_parallel.opt_state_shardings(mesh, cfg, tc.zero, optimizer, params_shape)
    compressed = tc.grad_compression != "none"
    outer_loop = bool(tc.local_steps or meta_cfg.algorithm)
    r_sharding = feedback.shardings(mesh, feedback_axes(mesh, outer_loop), cfg, p_sharding,
                                    tc.grad_compression) if compressed else None
    l_sharding = outer.local_shardings(mesh, inner, cfg, params_shape, tc) if tc.local_steps else None
    state_sharding = TrainState(NamedSharding(mesh, P()), p_sharding, o_sharding, r_sharding, l_sharding)
    batch_sharding = NamedSharding(mesh, P(None, DATA, CP))

    def init(rng: jax.Array) -> TrainState:
        params = llama.init_params(cfg, rng)
        if mc.pp > 1:
            params = pipeline_layout.to_pipeline_layout(params, mc.pp, pipeline.virtual_stages, pipeline.vshape)
        residual = _zero_feedback(params, mesh, cfg, tc, outer_loop) if compressed else None
        local = diloco.fresh(params, mesh.shape[DP]) if diloco else None
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), residual, local)

    spec = _step_spec(mesh, cfg, tc, moe, context, policy, meta_cfg)
    if mc.pp > 1:
        strategy = Pipelined(spec, tc.zero, g_sharding, pipeline, compression=tc.grad_compression)
    else:
        strategy = Accumulation(spec, tc.zero, g_sharding, tc.grad_compression)
    diloco = streaming.diloco_for(strategy, inner, optimizer, tc, mc.pp) if tc.local_steps else None
    learner = meta.Meta(spec, meta_cfg, optimizer, tc, strategy) if meta_cfg.algorithm else None
    step = functools.partial(train_step, strategy=strategy, optimizer=optimizer, tc=tc, bias_rate=moe.bias_update_rate)
    step = diloco.step if diloco else learner.step if learner else step
    options = _compile_options(mesh, tc, policy.fp8, params_shape)
    jit = functools.partial(jax.jit, compiler_options=options or None)
    return Trainer(
        mesh, cfg, tc, optimizer, state_sharding, batch_sharding,
        init=_on_mesh(mesh, jax.jit(init, out_shardings=state_sharding)),
        step=_on_mesh(mesh, jit(step, in_shardings=(state_sharding, batch_sharding),
                                out_shardings=(state_sharding, None), donate_argnums=0)),
        grads=_on_mesh(mesh, jit(lambda params, batch: strategy.loss_and_grads(params, batch)[:2],
                                 in_shardings=(p_sharding, batch_sharding), out_shardings=(None, p_sharding))),
        loss=_on_mesh(mesh, jit(strategy.mean_loss, in_shardings=(p_sharding, batch_sharding))),
        strategy=strategy,
        xla_options=options,
        pipeline=pipeline if mc.pp > 1 else None,
        diloco=diloco,
        learner=learner,
    )


def _step_spec(mesh: Mesh, cfg: LlamaConfig, tc: TrainConfig, moe: MoeConfig, context: ContextConfig,
               policy: Any, meta_cfg: MetaConfig) -> StepSpec:
    """The run's StepSpec: cp > 1's attention, and under MAML (differentiated through its adaptation) fp8 weights
    quantized by each GEMM (`StepSpec.quantize_once`)."""
    attention_fn = None
    if mesh.shape[CP] > 1:
        attention_fn = context_strategy.context_attention(context.strategy, select_attention(tc.attention))
    spec = StepSpec.build(cfg, tc, moe, attention_fn, policy)
    return dataclasses.replace(spec, quantize_once=False) if meta_cfg.algorithm == "maml" else spec


def _validated(mesh: Mesh, cfg: LlamaConfig, tc: TrainConfig, *sections: Any) -> MeshConfig:
    """The mesh's sizes, once the run's rules (`validate_run`) and its ZeRO groups accept the run."""
    mc = MeshConfig.of(mesh)
    validate_run(mc, cfg, tc, *sections)
    data_parallel.check_shard_groups(mesh, tc)
    return mc


def mesh_for(config: Config, devices: Any = None) -> Mesh:
    """The mesh a run's config asks for over `devices` (default: all): an unset mesh.ep filled in for its experts,
    leaving DiLoCo the two copies of them it averages (`outer.copies_needed`); ZeRO's shard groups of
    `train.zero_shard` data replicas; a tp across hosts refused unless `mesh.tp_across_hosts`."""
    mesh = make_mesh(config.mesh, devices, config.model.num_local_experts, outer.copies_needed(config.train),
                     config.train.zero_shard)
    hosts.check_tp(mesh, config.mesh.tp_across_hosts)
    return mesh


def trainer_for(mesh: Mesh, config: Config, tc: TrainConfig | None = None) -> Trainer:
    """`build_trainer` with every section of a run's config (`tc` in place of its train section): the step
    `pjax.train` runs, which the planner and the calibration compile too."""
    return build_trainer(mesh, config.model, config.train if tc is None else tc, config.pipeline, config.moe,
                         config.context, config.precision, config.meta)


def init_state(trainer: Trainer, rng: jax.Array, init_from: str | None = None) -> TrainState:
    """Fresh sharded state: random parameters, or a HuggingFace checkpoint's (`train.init_from`)."""
    if init_from is None:
        return trainer.init(rng)
    from models.hf import load_hf

    hf_cfg, params = load_hf(init_from, trainer.state_sharding.params,
                             make_vocab_size_divisible_by=trainer.cfg.make_vocab_size_divisible_by)
    ours, theirs = dataclasses.asdict(trainer.cfg), dataclasses.asdict(hf_cfg)
    diff = [f"model.{k}={ours[k]} (checkpoint: {theirs[k]})" for k in shape_keys(trainer.cfg.num_local_experts)
            if ours[k] != theirs[k]]
    if diff:
        raise ConfigError(f"train.init_from={init_from} does not match the config: {listed(diff, 65)}; use the "
                          f"checkpoint's values.")
    if trainer.pipeline is not None:  # checkpoints are in model order; the state in pipeline order
        params = jax.jit(functools.partial(pipeline_layout.to_pipeline_layout, pp=trainer.mesh.shape[PP],
                                           v=trainer.pipeline.virtual_stages, vshape=trainer.pipeline.vshape),
                         out_shardings=trainer.state_sharding.params)(params)
    opt_init = jax.jit(trainer.optimizer.init, out_shardings=trainer.state_sharding.opt_state)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_init(params), fresh_residual(trainer),
                      fresh_local(trainer, params))


def fresh_local(trainer: Trainer, params: Any, step: int = 0) -> Any:
    """DiLoCo's groups, every one at `params` with a fresh inner state (as of `step`); None without
    train.local_steps."""
    if trainer.diloco is None:
        return None
    fresh = functools.partial(trainer.diloco.fresh, groups=trainer.mesh.shape[DP], step=step)
    with jax.set_mesh(trainer.mesh):  # under ZeRO the groups' chunks are cut in a shard_map
        return jax.jit(fresh, out_shardings=trainer.state_sharding.local)(params)


def fresh_residual(trainer: Trainer) -> Any:
    """Zero error-feedback residuals on the trainer's mesh, or None without train.grad_compression."""
    if trainer.state_sharding.residual is None:
        return None
    shapes = trainer.abstract_state().params
    outer_loop = trainer.diloco is not None or trainer.learner is not None
    return jax.jit(lambda: _zero_feedback(shapes, trainer.mesh, trainer.cfg, trainer.tc, outer_loop),
                   out_shardings=trainer.state_sharding.residual)()


def _zero_feedback(params: Any, mesh: Mesh, cfg: LlamaConfig, tc: TrainConfig, outer_loop: bool) -> dict[str, Any]:
    """`feedback.zeros` for this run's compression (traced: the residual sharding places it)."""
    return feedback.zeros(params, mesh, feedback_axes(mesh, outer_loop), cfg, tc.grad_compression,
                          tc.compression_rank, tc.diloco_fragments)


def feedback_axes(mesh: Mesh, outer_loop: bool) -> tuple[str, ...]:
    """The axes a compressed reduction sums over, whose devices each keep a residual: the data axes, or with an
    outer loop (DiLoCo, meta-learning) dp alone (its one mean over the groups; a group's copies are alike over
    cp)."""
    return (DP,) if outer_loop else data_parallel.data_axes(mesh)


def _compile_options(mesh: Mesh, tc: TrainConfig, fp8: bool, params_shape: Any) -> dict[str, Any]:
    """The step's XLA options (`xla_options.step_options`); with streaming DiLoCo's overlap, a landing's fragment
    reductions (one per parameter tensor at most) all in flight beside its inner step."""
    in_flight = len(jax.tree.leaves(params_shape)) if tc.local_steps and tc.diloco_overlap else 1
    return xla_options.step_options(tc.xla_options, _local_device(mesh), fp8, in_flight)


def _local_device(mesh: Mesh) -> Any:
    """A device of `mesh` this process can compile for (on several hosts, one of its own)."""
    mine = [d for d in mesh.devices.flat if getattr(d, "process_index", 0) == jax.process_index()]
    return (mine or list(mesh.devices.flat))[0]


def _on_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """Run `fn` with `mesh` set, so the model's logical sharding constraints resolve against it."""
    def wrapped(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)
    wrapped.jitted = fn
    return wrapped
