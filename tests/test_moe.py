"""The MoE layer (models/moe.py): dropless and capacity routing equal the dense reference, capacity
drops exactly the assignments its rule says, expert parallelism over dp equals one device, and the
router and its load-balancing loss are Mixtral's (transformers' MixtralSparseMoeBlock)."""
import dataclasses
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import proofs
from mesh import ConfigError, MeshConfig, make_mesh
from models import llama, moe
from models.config import LlamaConfig
from pjax.config import PipelineConfig, TrainConfig
from pjax.observe.hlo import collective_stats
from pjax.parallel.context.zigzag import zigzag_layout
from pjax.parallel.pipeline import layout as ppl
from pjax.step import add_positions, build_trainer

N, D, F = 32, 16, 24  # tokens, hidden, expert MLP width


def layer(num_experts: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    p = {"router": rng.normal(size=(D, num_experts)).astype(np.float32),
         "w_gate": (0.3 * rng.normal(size=(num_experts, D, F))).astype(np.float32),
         "w_up": (0.3 * rng.normal(size=(num_experts, D, F))).astype(np.float32),
         "w_down": (0.3 * rng.normal(size=(num_experts, F, D))).astype(np.float32)}
    return x, p


@proofs.cache
def value_and_grads(num_experts: int, top_k: int, routing: str, capacity_factor: float, dp: int = 1, tp: int = 1):
    """Output, stats and d/d(x, params) of a non-trivial scalar of the output, on a dp x tp mesh."""
    x, p = layer(num_experts)

    def f(x, p):
        y, stats = moe.moe_mlp(x, p, top_k=top_k, config=moe.MoeConfig(routing, capacity_factor))
        return jnp.sum(y * jnp.sin(y)), (y, stats)

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    mesh = make_mesh(MeshConfig(dp=dp, tp=tp, ep=dp), jax.devices()[: dp * tp])
    with jax.set_mesh(mesh):
        (_, (y, stats)), grads = fn(x, p)
        hlo = fn.lower(x, p).compile().as_text()
    return np.asarray(y), jax.tree.map(np.asarray, stats), jax.tree.map(np.asarray, grads), hlo


def assert_close(got, want, rtol=1e-6):
    """Each leaf to rtol of its own scale, or of 1e-2 of the largest leaf's when it is (nearly) zero:
    top-1 routing's router gets no gradient from the output (its one weight is renormalised to 1); measured, its
    gradient is 4.6e-6 at most and 1.7e-6 off, 2.2e-6 of the floor, where its own scale would make it 0.36."""
    floor = 1e-2 * max(np.max(np.abs(w)) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), floor)
        assert err <= rtol, f"relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (4, 1)], ids=["top2_of_8", "top1_of_4"])
def test_dropless_and_ample_capacity_equal_the_dense_reference(num_experts, top_k):
    y, stats, grads, _ = value_and_grads(num_experts, top_k, "dense", 1.0)
    for routing, factor in [("dropless", 1.0), ("capacity", num_experts / top_k)]:  # factor E/k: C = N
        got_y, got_stats, got_grads, _ = value_and_grads(num_experts, top_k, routing, factor)
        assert_close(got_y, y)
        assert_close(got_grads, grads, rtol=1e-5)
        assert float(got_stats.dropped) == 0
        np.testing.assert_array_equal(got_stats.assigned, stats.assigned)


def test_capacity_drops_exactly_the_assignments_past_each_experts_capacity():
    """Rule: queue all first choices in token order, then all second choices; each expert keeps its
    first C. The kept assignments' weighted expert outputs are the dense reference's terms."""
    num_experts, top_k, factor = 8, 2, 0.25
    x, p = layer(num_experts)
    cap = moe.capacity(N, top_k, num_experts, factor)
    assert cap == 2  # ceil(0.25 * 32 * 2 / 8)
    weights, experts, _ = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), moe.Router(top_k))
    weights, experts = np.asarray(weights), np.asarray(experts)
    kept, taken = np.zeros_like(weights, bool), np.zeros(num_experts, int)
    for j in range(top_k):
        for n in range(N):
            e = experts[n, j]
            kept[n, j] = taken[e] < cap
            taken[e] += 1
    y, stats, _, _ = value_and_grads(num_experts, top_k, "capacity", factor)
    assert float(stats.dropped) == (~kept).sum() > 0
    dense = jax.jit(moe.dense_experts)
    want = np.asarray(dense(jnp.asarray(x), jnp.asarray(weights * kept), jnp.asarray(experts),
                            {k: jnp.asarray(v) for k, v in p.items()}))
    assert_close(y, want)
    every_choice_dropped = ~kept.any(axis=1)
    assert every_choice_dropped.any() and np.all(y[every_choice_dropped] == 0)  # the residual carries them


@pytest.mark.parametrize("dp,tp", [(2, 1), (4, 1), (8, 1), (2, 2)], ids=["dp2", "dp4", "dp8", "dp2_tp2"])
@pytest.mark.parametrize("routing", ["dropless", "capacity"])
def test_expert_parallel_over_dp_equals_one_device(routing, dp, tp):
    factor = 4.0  # capacity E/k: nothing dropped, so every layout computes the same
    y, stats, grads, _ = value_and_grads(8, 2, "dense", factor)
    got_y, got_stats, got_grads, hlo = value_and_grads(8, 2, routing, factor, dp, tp)
    assert_close(got_y, y)
    assert_close(got_grads, grads, rtol=1e-5)
    np.testing.assert_array_equal(got_stats.assigned, stats.assigned)
    assert float(got_stats.tokens) == N
    moved = collective_stats(hlo)["all-to-all"]
    if routing == "capacity":  # two all-to-alls forward (dispatch, combine) and their two transposes backward,
        # each moving the [E, C, D] buffer of a device's tokens: C = N/dp tokens (the capacity that never drops)
        assert moved == {"count": 4, "bytes": 4 * 8 * (N // dp) * D * 4}, moved
    else:  # the ragged exchanges' CPU stand-in: each slice padded to a device's N/dp*k assignments, and the
        # receivers' offsets (dp int32s) sent once per exchange forward (models/ragged_dispatch.py)
        assert moved == {"count": 6, "bytes": 4 * dp * (N // dp * 2) * D * 4 + 2 * dp * 4}, moved
        assert collective_stats(hlo)["all-gather"]["count"] >= 1  # every device's per-expert counts


def test_capacity_under_expert_parallelism_is_each_devices_own_queue():
    """GShard's groups: with experts over dp, each device's tokens queue for C = ceil(factor * n * k / E)
    places of their own, so dp=4 drops what one device drops on each quarter of the tokens."""
    x, p = layer(8)
    run = jax.jit(lambda x, p: moe.moe_mlp(x, p, top_k=2, config=moe.MoeConfig("capacity", 1.0)))
    quarters = [run(x[i * N // 4:(i + 1) * N // 4], p) for i in range(4)]
    with jax.set_mesh(make_mesh(MeshConfig(dp=4, ep=4), jax.devices()[:4])):
        y, stats = run(x, p)
    np.testing.assert_array_equal(np.asarray(y), np.concatenate([np.asarray(q[0]) for q in quarters]))
    assert float(stats.dropped) == sum(float(q[1].dropped) for q in quarters) > 0


def test_experts_that_do_not_split_over_ep_and_unknown_routings_are_config_errors():
    x, p = layer(6)
    mesh = make_mesh(MeshConfig(dp=4, ep=4), jax.devices()[:4])
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=re.escape("num_local_experts=6 is not divisible by mesh.ep=4")):
        moe.moe_mlp(jnp.asarray(x), p, top_k=2)
    with pytest.raises(ConfigError, match="moe.routing='sparse' is invalid"):
        moe.MoeConfig(routing="sparse")


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (4, 1)], ids=["top2_of_8", "top1_of_4"])
def test_router_experts_and_aux_loss_match_transformers_mixtral(num_experts, top_k):
    torch = pytest.importorskip("torch")
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral as hf

    config = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=num_experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0)
    block = hf.MixtralSparseMoeBlock(config).eval()
    xs = [layer(num_experts, seed)[0] for seed in (0, 1)]  # two "layers" for the aux loss
    _, p = layer(num_experts)
    with torch.no_grad():  # HF layouts: router [E, D], gate_up [E, 2F, D] (gate first), down [E, D, F]
        block.gate.weight.copy_(torch.tensor(p["router"].T))
        block.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([p["w_gate"], p["w_up"]], axis=2).transpose(0, 2, 1)))
        block.experts.down_proj.copy_(torch.tensor(p["w_down"].transpose(0, 2, 1)))
        want = block(torch.tensor(xs[0])[None])[0].numpy()
        router_logits = tuple(block.gate(torch.tensor(x))[0] for x in xs)
        want_aux = float(hf.load_balancing_loss_func(router_logits, num_experts, top_k))
    y, _ = jax.jit(functools.partial(moe.moe_mlp, top_k=top_k))(jnp.asarray(xs[0]), p)
    assert np.max(np.abs(np.asarray(y) - want)) <= 1e-5 * np.max(np.abs(want))
    stats = [moe.route(jnp.asarray(x), jnp.asarray(p["router"]), moe.Router(top_k))[2] for x in xs]
    summed = jax.tree.map(lambda a, b: a + b, *stats)
    assert float(moe.aux_losses(summed, layers=2)["aux_loss"]) == pytest.approx(want_aux, rel=1e-6)


# -- the MoE model in the training step ------------------------------------------------------------
MOE_CFG = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05, num_local_experts=8,
                      num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
MOE_TC = TrainConfig(seq_len=16, batch_size=16, grad_accum=2, dtype="float32", steps=10, warmup_steps=2)


def text_batch():
    tokens = np.random.default_rng(0).integers(0, MOE_CFG.vocab_size, (16, 17)).astype(np.int32).reshape(2, 8, 17)
    return add_positions({"inputs": jnp.asarray(tokens[..., :-1]), "labels": jnp.asarray(tokens[..., 1:])})


def moe_layout(dp: int, tp: int = 1, zero: int = 0, routing: str = "dropless", cp: int = 1, pp: int = 1,
               sequence_parallel: bool = False, grad_accum: int = MOE_TC.grad_accum, schedule: str = "1f1b",
               layers: int = MOE_CFG.num_hidden_layers, family: str = "mixtral", ep: int | None = None):
    """The layouts these tests train on (a signature only); the experts over `ep` of the dp devices (all of dp
    by default)."""


LAYOUT = inspect.signature(moe_layout)


def cache_by_layout(fn):
    """`functools.cache` keyed on the full layout (moe_trainer's arguments, defaults filled in):
    moe_trainer(2) and moe_trainer(2, 1, 0, "dropless") are one trainer and share their compiles."""
    cached = proofs.cache(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = LAYOUT.bind(*args, **kwargs)
        bound.apply_defaults()
        return cached(*bound.args)
    return call


@cache_by_layout
def moe_trainer(dp, tp, zero, routing, cp, pp, sequence_parallel, grad_accum, schedule, layers, family, ep):
    mesh = make_mesh(MeshConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep or dp), jax.devices()[: dp * pp * cp * tp])
    tc = dataclasses.replace(MOE_TC, zero=zero, sequence_parallel=sequence_parallel, grad_accum=grad_accum)
    pipeline = PipelineConfig(schedule=schedule, virtual_stages=2 if schedule == "zb_v" else 1)
    return build_trainer(mesh, moe_cfg(layers, family), tc, pipeline,
                         moe=moe.MoeConfig(routing=routing, capacity_factor=4.0))


FAMILIES = {"mixtral": {},  # and the other families' options: Qwen3-MoE's per-head q/k norms, Qwen2-MoE's q/k/v
            # biases and sigmoid-gated shared expert, both with the softmax's own top-k weights
            "qwen3": dict(qk_norm=True, norm_topk_prob=False),
            "qwen2": dict(qkv_bias=True, shared_expert_intermediate_size=40, norm_topk_prob=False),
            # DeepSeek-V3's routing: sigmoid scores, a selection bias (random here, so that it changes the choice)
            "sigmoid": dict(router_score="sigmoid")}


def moe_cfg(layers: int = MOE_CFG.num_hidden_layers, family: str = "mixtral") -> LlamaConfig:
    return dataclasses.replace(MOE_CFG, num_hidden_layers=layers, **FAMILIES[family])


@functools.cache
def moe_params(layers: int = MOE_CFG.num_hidden_layers, family: str = "mixtral"):
    params = jax.tree.map(np.asarray, llama.init_params(moe_cfg(layers, family), jax.random.key(0)))
    rng = np.random.default_rng(1)  # norm scales initialise to 1 and biases to 0: others make a mix-up show
    for name in ("q_norm", "k_norm", "bq", "bk", "bv", "router_bias"):
        if name in params["layers"]:
            params["layers"][name] = (params["layers"][name] + 0.2 * rng.normal(size=params["layers"][name].shape)
                                      ).astype(np.float32)
    return params


def family_of(cfg: LlamaConfig) -> str:
    return ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "sigmoid" if cfg.router_score == "sigmoid"
            else "mixtral")


def _pipeline_order(trainer) -> tuple[int, int, bool]:
    """(pp, v, vshape) of the trainer's stored layer order."""
    pipeline = trainer.pipeline
    return trainer.mesh.shape["pp"], pipeline.virtual_stages if pipeline else 1, bool(pipeline and pipeline.vshape)


def params_for(trainer):
    """The same parameters on every layout, in the trainer's layer order and sharding (a trainer's own
    init would compile once per layout)."""
    params = moe_params(trainer.cfg.num_hidden_layers, family_of(trainer.cfg))
    return jax.device_put(ppl.to_pipeline_layout(params, *_pipeline_order(trainer)), trainer.state_sharding.params)


@cache_by_layout
def loss_grads_router(*layout):
    """Loss, gradients and router metrics of the step's gradient computation (its strategy's
    `loss_and_grads`, which `train_step` reports the metrics of), from one compile."""
    trainer = moe_trainer(*layout)
    fn = jax.jit(trainer.strategy.loss_and_grads, in_shardings=(trainer.state_sharding.params, trainer.batch_sharding))
    params, batch = params_for(trainer), batch_for(trainer)
    with jax.set_mesh(trainer.mesh):
        loss, grads, router = fn(params, batch)
    grads = ppl.to_model_layout(jax.tree.map(np.asarray, grads), *_pipeline_order(trainer))
    return float(loss), grads, jax.tree.map(float, router)


def batch_for(trainer):
    """The test batch on the trainer's mesh, in ring attention's zigzag order when cp > 1."""
    cols = np.asarray(zigzag_layout(trainer.mesh.shape["cp"])(np.arange(MOE_TC.seq_len)))
    return jax.device_put(jax.tree.map(lambda a: np.asarray(a)[..., cols], text_batch()), trainer.batch_sharding)


@cache_by_layout
def compiled_step(*layout):
    """The train step of a layout, compiled once ahead of time: for its HLO and to run."""
    return moe_trainer(*layout).compile_step()


@cache_by_layout
def step_metrics(*layout):
    trainer = moe_trainer(*layout)
    _, metrics = compiled_step(*layout)(trainer.init(jax.random.key(0)), batch_for(trainer))
    return jax.tree.map(float, metrics)


def assert_equal_one_device(layout):
    named = LAYOUT.bind(*layout).arguments
    ref_loss, ref_grads, ref_router = loss_grads_router(1, layers=named.get("layers", MOE_CFG.num_hidden_layers),
                                                        family=named.get("family", "mixtral"))
    loss, grads, router = loss_grads_router(*layout)
    assert abs(loss - ref_loss) <= 1e-6
    assert_close(grads, ref_grads, rtol=1e-5)
    for key in moe.ROUTER_METRICS:  # statistics of the whole batch, wherever its tokens were routed
        assert router[key] == pytest.approx(ref_router[key], rel=1e-5), key


# Experts over ep is in each of these, ep 2, 4 and 8: over half of dp under ZeRO-3 (no reduce-once, the experts
# copied over dp's two replicas), with ring attention over cp and tp, capacity routing with ZeRO-1's
# reduce-scatter under tp and sequence parallelism (ep half of dp), over all of dp beside cp under ZeRO-1, and
# over all 8 devices. The pipelined layouts below cover it under pp, with dp x cp x pp the smallest that has dp
# inside a pipeline, and ZB-H1 with ep half of dp.
EP_LAYOUTS = {"dp4_ep2_zero3": dict(dp=4, zero=3, ep=2), "dp2_ep2_cp2_tp2": dict(dp=2, tp=2, cp=2),
              "dp4_ep2_tp2_zero1_capacity_sequence_parallel": dict(dp=4, tp=2, zero=1, routing="capacity",
                                                                  sequence_parallel=True, ep=2),
              "dp4_ep4_cp2_zero1": dict(dp=4, cp=2, zero=1), "dp8_ep8": dict(dp=8)}


def layout_args(**named) -> tuple:
    """`moe_layout`'s arguments as a tuple, defaults filled in (`bind(...).args` alone stops at the first default
    left out, and loses every keyword after it)."""
    bound = LAYOUT.bind(**named)
    bound.apply_defaults()
    return tuple(bound.args)


@pytest.mark.parametrize("layout", [layout_args(**kw) for kw in EP_LAYOUTS.values()], ids=list(EP_LAYOUTS))
@pytest.mark.proves("sp+moe", "zero3+moe")
def test_moe_training_loss_grads_and_router_metrics_with_experts_over_ep_equal_one_device(layout):
    assert_equal_one_device(layout)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_qwen_moe_options_in_the_step_equal_one_device(family):
    """Qwen3-MoE's per-head q/k norms, or Qwen2-MoE's q/k/v biases and shared expert, with unrenormalised top-k
    weights and the experts over dp (ragged dropless) under tp, sequence parallelism and ZeRO-1 (which keeps the
    norms and biases, weights with no 'embed' axis, whole): the loss, gradients (the new parameters' included,
    each non-zero) and router metrics of one device."""
    assert_equal_one_device((2, 2, 1, "dropless", 1, 1, True, MOE_TC.grad_accum, "1f1b", MOE_CFG.num_hidden_layers,
                             family))
    _, grads, _ = loss_grads_router(1, family=family)
    for name in set(grads["layers"]) - set(loss_grads_router(1)[1]["layers"]):
        assert np.abs(grads["layers"][name]).max() > 0, name


@pytest.mark.parametrize("layout", [(1, 1, 0, "dropless", 1, 2), (2, 2, 1, "capacity", 1, 2),
                                    (2, 1, 0, "dropless", 2, 2)],
                         ids=["pp2", "dp2_pp2_tp2_zero1_capacity", "dp2_cp2_pp2"])
def test_moe_pipeline_loss_grads_router_metrics_and_eval_loss_equal_one_device(layout):
    """The router statistics travel with the activations between stages, so every stage's router
    gets the load-balancing loss's gradient of the whole model (pjax/parallel/pipeline/stage.py).
    The evaluation (a forwards-only table, router losses included) gives the training loss."""
    assert_equal_one_device(layout)
    trainer = moe_trainer(*layout)
    assert float(trainer.loss(params_for(trainer), batch_for(trainer))) == pytest.approx(loss_grads_router(1)[0], abs=1e-6)


# Zero-bubble: the router statistics travel with the activations (forward) and their cotangents (B), as in
# 1F1B; the experts and the router keep their weight gradients in B, W takes attention's projections
# (models/deferred_grads.py). Four layers, so that ZB-V's V has a layer per half stage.
ZB_MOE = [(4, 1, 0, "dropless", 1, 2, False, 2, "zb_h1", 4, "mixtral", 2),
          (2, 2, 0, "dropless", 1, 2, False, 2, "zb_v", 4)]


@pytest.mark.parametrize("layout", ZB_MOE, ids=["dp4_ep2_pp2_zb_h1", "dp2_tp2_pp2_zb_v"])
@pytest.mark.proves("zb_h1+moe", "zb_v+moe")
def test_moe_zero_bubble_loss_grads_and_router_metrics_equal_one_device(layout):
    """ZB-H1 with the experts over ep, half of dp (their all-to-alls in F and B); ZB-V's V with them over dp and
    each expert over tp (its slots' tp splits not probed: `slot_splits`)."""
    assert_equal_one_device(layout)


@pytest.mark.parametrize("pp", [1, 2], ids=["step", "pipeline"])
def test_moe_reduces_dense_gradients_over_dp_once_per_step_and_expert_gradients_never(pp):
    """dp=2 at 2 and 4 micro-batches: what is all-reduced over dp is the dense (non-expert)
    gradient a device holds, once, plus the router statistics' few floats per layer and
    micro-batch (or pipeline tick). Expert gradients arrive at their owner by the all_to_all's
    backward and are not reduced (294,912 bytes here, against 92,800 dense)."""
    from pjax.observe.hlo import collectives_by_axis
    from pjax.parallel.data_parallel import is_expert

    names = jax.tree.leaves(llama.param_logical_axes(MOE_CFG), is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(jax.eval_shape(lambda: llama.init_params(MOE_CFG, jax.random.key(0))))
    dense = sum(4 * np.prod(s.shape) // (pp if n[0] == "layers" else 1)  # a stage holds its layers
                for s, n in zip(shapes, names) if not is_expert(n))

    def reduced(grad_accum):  # bytes all-reduced or reduce-scattered over dp per step (the all-to-alls, and the
        # all-gathers of the routing's per-expert counts, integers, left out)
        layout = (2, 1, 0, "dropless", 1, pp, False, grad_accum)
        routing = lambda kind, line: kind == "all-to-all" or (kind == "all-gather" and "= s32[" in line)  # noqa: E731
        rows = collectives_by_axis(compiled_step(*layout).as_text(), dict(moe_trainer(*layout).mesh.shape),
                                   scale=lambda kind, line: not routing(kind, line))
        return rows["dp"]["bytes"]

    assert dense <= reduced(2) <= dense + 1024, (reduced(2), dense)
    assert abs(reduced(4) - reduced(2)) <= 1024, (reduced(4), reduced(2))


def test_moe_step_adds_the_router_losses_and_reports_them_alike_on_any_layout():
    """The step on dp=2 (experts over dp) reports the loss and the router metrics of one device's
    gradient computation; the loss is the cross-entropy plus the weighted router losses."""
    loss, _, router = loss_grads_router(1)
    metrics = step_metrics(2)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    for key in moe.ROUTER_METRICS:
        assert metrics[key] == pytest.approx(router[key], rel=1e-5), key
    assert metrics["aux_loss"] > 0 and metrics["z_loss"] > 0 and metrics["dropped_fraction"] == 0
    assert metrics["load_min"] <= 1.0 <= metrics["load_max"]
    plain = dataclasses.replace(MOE_CFG, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    trainer = build_trainer(make_mesh(MeshConfig(dp=1), jax.devices()[:1]), plain, MOE_TC)
    cross_entropy = float(trainer.loss(moe_params(), text_batch()))
    assert loss == pytest.approx(cross_entropy + 0.1 * metrics["aux_loss"] + 0.01 * metrics["z_loss"], rel=1e-6)


def test_moe_checkpoint_restores_onto_another_expert_layout(tmp_path):
    """Saved with 4 experts per device (dp = ep = 2), restored with 2 per device under tp=2 (dp = ep = 4 x tp=2):
    every leaf equal and on its new sharding, and the next step's loss the same."""
    from pjax.checkpoint.checkpointer import Checkpointer
    from pjax.config import Config

    config = Config(model=MOE_CFG, train=MOE_TC)
    saver, step = moe_trainer(2), compiled_step(2)  # the step test_moe_step_adds_the_router_losses_... ran
    state, _ = step(saver.init(jax.random.key(0)), jax.device_put(text_batch(), saver.batch_sharding))
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state, data={"position": 1}, rng=jax.random.key(1), config=config)
    saved = jax.tree.map(lambda a: np.array(a, copy=True), state)
    _, want = step(state, jax.device_put(text_batch(), saver.batch_sharding))
    loader = moe_trainer(4, 2)
    with Checkpointer(str(tmp_path)) as ckpt:
        restored = ckpt.restore(loader, config).state
    assert restored.params["layers"]["w_gate"].addressable_shards[0].data.shape[1] == 2  # 8 experts / ep=4
    for got, ref in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(got), ref)
    _, metrics = loader.step(restored, jax.device_put(text_batch(), loader.batch_sharding))
    assert float(metrics["loss"]) == pytest.approx(float(want["loss"]), abs=1e-6)
