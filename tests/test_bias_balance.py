"""Sigmoid routing with bias-based balancing (models/bias_balance.py, DeepSeek-V3's): the bias selects and never
weighs, each layer's load rides its bias' gradient through every layout, and the step moves the bias by the load's
sign outside the optimizer."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import bias_balance, moe
from models.config import LlamaConfig
from mesh import ConfigError
from test_moe import MOE_CFG, assert_close, batch_for, compiled_step, layer, loss_grads_router, moe_trainer

SIGMOID = "sigmoid"  # test_moe.FAMILIES' DeepSeek-V3 routing, with a random selection bias


def test_the_bias_selects_experts_and_never_weighs_them():
    x, p = layer(8)
    router = moe.Router(2, normalize=True, score="sigmoid")
    weights, experts, _ = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), router)
    favoured = jnp.zeros(8).at[5].set(10.0)  # past any sigmoid gap: expert 5 is every token's first choice
    b_weights, b_experts, stats = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), router, favoured)
    assert (np.asarray(b_experts)[:, 0] == 5).all() and not (np.asarray(experts)[:, 0] == 5).all()
    scores = jax.nn.sigmoid(jnp.asarray(x) @ jnp.asarray(p["router"]))
    chosen = np.take_along_axis(np.asarray(scores), np.asarray(b_experts), axis=-1)
    np.testing.assert_allclose(np.asarray(b_weights), chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    assert float(stats.assigned[5]) == x.shape[0]


def test_a_layer_s_load_is_its_bias_gradient():
    """d/d(bias) of any loss is the assigned counts, whatever the loss: the tap ignores its cotangent."""
    x, p = layer(8)
    bias = jnp.asarray(np.random.default_rng(3).normal(size=8), jnp.float32)
    router = moe.Router(2, score="sigmoid")

    def loss(bias, scale):
        weights, _, stats = moe.route(jnp.asarray(x), jnp.asarray(p["router"]), router, bias)
        return scale * jnp.sum(weights ** 2), stats

    for scale in (1.0, -3.0):
        grad, stats = jax.grad(loss, has_aux=True)(bias, scale)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(stats.assigned))


# ep 2 of dp 4 under ZeRO-1, and a 1F1B pipeline with dp 2: each layer's load (its bias' "gradient") is one
# device's, and so are the loss and every real gradient.
BIAS_LAYOUTS = {"dp4_ep2_zero1": (4, 1, 1, "dropless", 1, 1, False, 2, "1f1b", 2, SIGMOID, 2),
                "dp2_pp2": (2, 1, 0, "dropless", 1, 2, False, 2, "1f1b", 2, SIGMOID)}


@pytest.mark.parametrize("layout", list(BIAS_LAYOUTS.values()), ids=list(BIAS_LAYOUTS))
def test_sigmoid_routing_and_each_layer_s_load_equal_one_device(layout):
    """The loss and gradients of one device; each layer's load (its bias' "gradient") is one device's counts, up
    to the scale a strategy puts on its gradients (a pipeline's is the counts, the others' the counts per token),
    so as the step reads them, shares of a layer's assignments."""
    loss, grads, _ = loss_grads_router(*layout)
    ref_loss, ref_grads, _ = loss_grads_router(1, family=SIGMOID)
    loads, grads = bias_balance.split_loads(grads)
    ref_loads, ref_grads = bias_balance.split_loads(ref_grads)
    assert abs(loss - ref_loss) <= 1e-6
    assert_close(grads, ref_grads, rtol=1e-5)
    np.testing.assert_allclose(loads, ref_loads, rtol=1e-6, atol=0)
    assert loads.shape == (MOE_CFG.num_hidden_layers, MOE_CFG.num_local_experts)
    np.testing.assert_allclose(np.asarray(loads).sum(-1), 1.0, rtol=1e-6)
    assert float(np.ptp(np.asarray(ref_loads))) > 0.05  # uneven (measured 0.40), so a wrong layer or expert would show


def test_the_step_moves_the_bias_by_the_load_s_sign_outside_the_optimizer():
    trainer = moe_trainer(2, family=SIGMOID)
    state = trainer.init(jax.random.key(0))
    batch = batch_for(trainer)
    with jax.set_mesh(trainer.mesh):
        _, grads, _ = jax.jit(trainer.strategy.loss_and_grads)(state.params, batch)
    loads = np.asarray(bias_balance.split_loads(grads)[0])
    before = np.array(state.params["layers"][bias_balance.BIAS])  # the step donates its state
    new, metrics = compiled_step(2, family=SIGMOID)(state, batch)
    want = before + 0.001 * np.sign(loads.mean(-1, keepdims=True) - loads)
    np.testing.assert_allclose(np.asarray(new.params["layers"][bias_balance.BIAS]), want, rtol=0, atol=1e-9)
    assert np.abs(want - before).max() > 0
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    norm = float(np.sqrt(sum(np.sum(np.square(g)) for path, g in leaves if path[-1].key != bias_balance.BIAS)))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)  # the loads are in no norm or clip


def test_sigmoid_routing_keys_are_checked_and_have_no_hf_export():
    with pytest.raises(ConfigError, match="model.router_score='tanh' is invalid"):
        dataclasses.replace(MOE_CFG, router_score="tanh")
    with pytest.raises(ConfigError, match="moe.bias_update_rate=-1 is invalid"):
        moe.MoeConfig(bias_update_rate=-1)
    with pytest.raises(ConfigError, match="router_score=sigmoid has no HF form"):
        dataclasses.replace(MOE_CFG, router_score="sigmoid").hf_type
    assert LlamaConfig(router_score="sigmoid").hf_type == "llama"  # a dense model has no router to score
