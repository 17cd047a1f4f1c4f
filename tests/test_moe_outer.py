"""MoE under the outer loops (DiLoCo, streaming DiLoCo, meta-learning): a replica is an expert group of ep devices
that holds every expert once. Each group steps as one device does on its rows, its router statistics, balancing
loss and selection-bias loads its own (`mesh.replica_groups`; summed over all of dp, the balancing loss' gradient
would couple the groups); the outer step averages the groups' experts as any weight; the meta-learners' groups
adapt as one device does their tasks. Where an outer loop cannot run with an MoE, one line says so."""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from mesh.errors import ConfigError
from models import bias_balance
from pjax.config_io import load_config
from pjax.parallel import outer, streaming
from pjax.step import TrainState, mesh_for, train_step
from pjax.validate import validate_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402

# mixtral-tiny cut small: 8 experts, top-2, 2 layers; balancing losses strong enough that coupling would show.
SMALL = ["model.vocab_size=256", "model.hidden_size=32", "model.intermediate_size=48", "train.batch_size=16",
         "train.seq_len=16", "train.grad_accum=2", "train.dtype=float32", "mesh.tp=1", "train.warmup_steps=0",
         "train.grad_clip=0", "model.router_aux_loss_coef=0.1", "model.router_z_loss_coef=0.01"]
SIGMOID = ["model.router_score=sigmoid", "moe.bias_update_rate=0.01"]
SGD = optax.sgd(optax.constant_schedule(0.5))  # a schedule: the step reports its lr from the count
host = functools.partial(jax.tree.map, np.asarray)


def _trainer(overrides: list[str]):
    return trainer_for("mixtral-tiny", [*SMALL, *overrides])[1]


def _close(got, want, rtol=1e-5, atol=1e-8) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


def _biased(params):
    """`params` with random selection biases (zeros at init would not change a choice)."""
    params = host(params)
    if "router_bias" in params["layers"]:
        bias = params["layers"]["router_bias"]
        params["layers"]["router_bias"] = (0.2 * np.random.default_rng(1).normal(size=bias.shape)).astype(np.float32)
    return params


def _one_device(model: list[str], rows: int, params, batches) -> list:
    """Each group's reference: one device's SGD steps on its `rows` of every batch (the selection biases moved as
    `train_step` moves them): per group, the parameters after each step."""
    single = _trainer(["mesh.dp=1", f"train.batch_size={2 * rows}", *model])
    step = jax.jit(functools.partial(train_step, strategy=single.strategy, optimizer=SGD, tc=single.tc,
                                     bias_rate=single.strategy.spec.moe.bias_update_rate))
    groups = batches[0]["inputs"].shape[1] // rows
    out = []
    with jax.set_mesh(single.mesh):
        for g in range(groups):
            state, after = TrainState(np.int32(0), params, SGD.init(params)), []
            for batch in batches:
                state = step(state, jax.tree.map(lambda x: x[:, g * rows:(g + 1) * rows], batch))[0]
                after.append(host(state.params))
            out.append(after)
    return out


# (layout, model): 1F1B pipelines of ep 2 (dp 4 x pp 2, a group per expert group); groups of 2 expert groups (dp 8,
# ep 2) under ZeRO-1 (the inner state sharded within each group, on its ring), with sigmoid routing's biases.
DILOCO = {"dp4_ep2_pp2_1f1b": (["mesh.dp=4", "mesh.ep=2", "mesh.pp=2"], []),
          "dp8_ep2_zero1_groups_of_2_sigmoid": (["mesh.dp=8", "mesh.ep=2", "train.zero=1", "train.diloco_groups=2"],
                                                SIGMOID)}


@pytest.mark.parametrize("case", list(DILOCO))
@pytest.mark.proves("moe+diloco")
def test_each_expert_group_steps_as_one_device_on_its_rows_and_the_outer_step_averages_the_groups(case):
    """H=2, SGD inside, two steps: after the first, every replica of a group holds what one device's step on the
    group's rows makes (experts, router, biases included), alike to the bit within the group; after the second,
    the global parameters took the outer Nesterov step along (global - the mean of the groups' references)."""
    layout, model = DILOCO[case]
    trainer = _trainer([*layout, *model, "train.local_steps=2"])
    replicas, groups = trainer.mesh.shape["dp"], trainer.tc.diloco_groups or trainer.mesh.shape["dp"]
    params = _biased(trainer.init(jax.random.key(0)).params)
    diloco = dataclasses.replace(trainer.diloco, inner=SGD)
    batches = [host(random_batch(trainer, seed)) for seed in range(2)]
    step = jax.jit(diloco.step)
    with jax.set_mesh(trainer.mesh):  # under ZeRO the groups' state is cut into chunks in a shard_map
        state = TrainState(np.int32(0), params, trainer.optimizer.init(params), None, diloco.fresh(params, replicas))
        first, metrics = step(state, jax.device_put(batches[0], trainer.batch_sharding))
        copies = host(first.local["params"])
        second = host(step(first, jax.device_put(batches[1], trainer.batch_sharding))[0])
    assert {"load_max", "aux_loss"} <= set(metrics)  # the groups' mean router metrics
    want = _one_device(model, trainer.tc.batch_size // trainer.tc.grad_accum // groups, params, batches)
    per = replicas // groups
    for replica in range(replicas):
        mine = jax.tree.map(lambda x: x[replica], copies)
        _close(mine, want[replica // per][0])
        _close(mine, jax.tree.map(lambda x: x[replica - replica % per], copies), rtol=0, atol=0)
    lr, mu = trainer.tc.outer_lr, trainer.tc.outer_momentum
    mean = jax.tree.map(lambda *xs: np.mean(np.asarray(xs, np.float64), axis=0), *(w[1] for w in want))
    moved = jax.tree.map(lambda p, m: p - lr * (1 + mu) * (p - m), host(params), mean)
    _close(second.params, moved, atol=1e-7)


@pytest.mark.proves("moe+streaming")
def test_streaming_lands_each_fragment_of_the_experts_alone():
    """dp4 x ep2 x tp2, H=2 in 2 fragments (one sent and landed after each step), alpha=0.5: after step 1 the global
    layer 0 (fragment 0: its experts, router and attention) took the outer step along (global - the groups' mean),
    layer 1 did not move, and each group's copy is its own half-mixed with the landed layer 0, its own layer 1."""
    trainer = _trainer(["mesh.dp=4", "mesh.ep=2", "mesh.tp=2", "train.local_steps=2", "train.diloco_fragments=2",
                        "train.diloco_mix=0.5"])
    assert isinstance(trainer.diloco, streaming.StreamingDiLoCo)
    state = trainer.init(jax.random.key(0))
    params, batch = host(state.params), host(random_batch(trainer))
    diloco = dataclasses.replace(trainer.diloco, inner=SGD)
    state = state._replace(local=outer.fresh_local(state.params, SGD, 2))
    with jax.set_mesh(trainer.mesh):
        new = host(jax.jit(diloco.step)(state, jax.device_put(batch, trainer.batch_sharding))[0])
    own = [w[0] for w in _one_device([], 4, params, [batch])]
    lr, mu = trainer.tc.outer_lr, trainer.tc.outer_momentum
    layer = lambda tree, i: jax.tree.map(lambda x: np.asarray(x)[i], tree["layers"])  # noqa: E731
    mean = jax.tree.map(lambda a, b: (np.asarray(a, np.float64) + b) / 2, layer(own[0], 0), layer(own[1], 0))
    landed = jax.tree.map(lambda p, m: p - lr * (1 + mu) * (p - m), layer(params, 0), mean)
    _close(layer(new.params, 0), landed, atol=1e-7)
    _close(layer(new.params, 1), layer(params, 1), rtol=0, atol=0)
    for g in range(2):
        copy = jax.tree.map(lambda x: x[g], new.local["params"])
        _close(layer(copy, 0), jax.tree.map(lambda a, b: 0.5 * a + 0.5 * b, layer(own[g], 0), landed), atol=1e-7)
        _close(layer(copy, 1), layer(own[g], 1))


def _meta(algorithm: str) -> list[str]:
    query = 0 if algorithm == "reptile" else 1
    return [f"meta.algorithm={algorithm}", "meta.inner_steps=1", f"train.grad_accum={1 + query}",
            "meta.tasks=[t0.txt,t1.txt]", "train.batch_size=8"]


def _shares(tree):
    """The selection biases' loads as shares (`split_loads`): a strategy scales them by its token count."""
    if "router_bias" not in tree["layers"]:
        return tree, None
    loads, rest = bias_balance.split_loads(tree)
    return rest, loads


# (algorithm, layout and model): Reptile over dp 4 with ep 2, sigmoid routing (the inner steps move the biases by
# their loads); first-order MAML on 1F1B pipelines of ep 2; MAML (through the inner steps) over ep 2 with capacity
# routing that drops nothing (dropless' grouped GEMM has no second derivative: refused below).
META = {"reptile": ["mesh.dp=4", "mesh.ep=2", *SIGMOID],
        "fomaml": ["mesh.dp=4", "mesh.ep=2", "mesh.pp=2", *SIGMOID],
        "maml": ["mesh.dp=4", "mesh.ep=2", "moe.routing=capacity", "moe.capacity_factor=4"]}


@pytest.mark.parametrize("algorithm", list(META))
@pytest.mark.proves("moe+reptile", "moe+fomaml")  # moe+maml: the matrix's dropless MoE is refused
def test_expert_groups_adapt_to_their_tasks_as_one_device_does_them_in_turn(algorithm):
    """Two expert groups of ep 2, one task each: the mean over the groups of what each returns (Reptile's adapted
    parameters, the MAMLs' meta-gradients with their query's loads) equals one device's `per_task` on each group's
    rows, averaged."""
    layout = META[algorithm]
    parallel = _trainer([*layout, *_meta(algorithm)])
    single = _trainer(["mesh.dp=1", *[o for o in layout if not o.startswith("mesh.")], *_meta(algorithm)])
    params, batch = _biased(parallel.init(jax.random.key(0)).params), host(random_batch(parallel))
    with jax.set_mesh(parallel.mesh):
        got = jax.jit(parallel.learner.over_tasks)(params, batch)
    rows = batch["inputs"].shape[1] // 2
    with jax.set_mesh(single.mesh):
        per_task = jax.jit(single.learner.per_task)
        each = [per_task(params, jax.tree.map(lambda x: x[:, g * rows:(g + 1) * rows], batch)) for g in range(2)]
    want = jax.tree.map(lambda a, b: (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2, *each)
    if algorithm == "reptile":  # the adapted parameters, biases included
        _close(got, want)
        return
    (got_rest, got_loads), (want_rest, want_loads) = _shares(host(got[0])), _shares(want[0])
    _close((got_rest, got[1:]), (want_rest, want[1:]))
    if want_loads is not None:
        _close(got_loads, want_loads)


def test_an_unset_ep_leaves_diloco_two_copies_of_the_experts():
    """mesh.ep unset: the largest that keeps dp / ep >= 2 under DiLoCo (all of dp without an outer loop)."""
    for overrides, ep in ((["train.local_steps=2"], 4), ([], 8)):
        assert mesh_for(load_config("mixtral-tiny", [*SMALL, "mesh.dp=8", *overrides])).shape["ep"] == ep


@pytest.mark.parametrize("overrides, message", [
    (["mesh.dp=4", "mesh.ep=4", "train.local_steps=2"],
     r"the experts span all mesh.dp=4 replicas \(mesh.ep=4\): set mesh.ep to a divisor of 4 below it"),
    (["mesh.dp=8", "mesh.ep=2", "train.local_steps=2", "train.diloco_groups=3"],
     r"the groups split the 4 copies of the experts \(mesh.dp=8 / mesh.ep=2\) evenly; use a divisor of 4"),
    (["mesh.dp=4", "mesh.ep=2", *_meta("maml")], r"moe.routing=dropless: use moe.routing=capacity with "
                                                r"moe.capacity_factor >= \d"),
    (["mesh.dp=4", "mesh.ep=2", *_meta("reptile"), "meta.tasks=[a.txt,b.txt,c.txt]"],
     r"3 tasks, which do not divide over the 2 \(mesh.dp=4 / mesh.ep\) groups"),
])
def test_what_an_moe_cannot_do_under_an_outer_loop_is_one_line(overrides, message):
    cfg = load_config("mixtral-tiny", [*SMALL, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_run(cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.context, cfg.precision, cfg.meta, cfg.moe)
