"""DiLoCo (`train.local_steps`, pjax/parallel/outer.py): with H=1, an outer lr of 1, no momentum and SGD inside
it is synchronous training; between synchronisations the groups drift apart on their own rows and the global
parameters wait; at each one the outer Nesterov step moves them by the groups' mean delta and every group
restarts from them; a resume continues bit for bit."""
from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh.errors import ConfigError
from pjax.config_io import load_config
from pjax.parallel import groups, outer
from pjax.step import TrainState, train_step
from pjax.train import train
from pjax.validate import validate_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import random_batch, trainer_for  # noqa: E402
from closeness import assert_close_but_a_few  # noqa: E402
from run_helpers import preempted_after  # noqa: E402

SMALL = ["train.batch_size=8", "train.seq_len=32", "train.grad_accum=2", "train.dtype=float32"]


def _trainer(overrides: list[str]):
    return trainer_for("debug", [*SMALL, *overrides])


# Default: two programs' fp32 sums, a parameter near 1 an ulp or two apart (measured 2.4e-7); stepping on another
# group's rows is off by a whole SGD step at lr 0.5 (reasoned).
def _close(a, b, rtol=2e-5, atol=2e-7) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _embedding(params) -> np.ndarray:
    return np.asarray(jax.tree.leaves(params["embed"])[0])


@pytest.mark.proves("1f1b+diloco")
def test_one_local_step_at_outer_lr_1_without_momentum_is_synchronous_training():
    """dp2 x pp2 x tp2 (a group is a 1F1B pipeline with tp inside), two steps: SGD's update of the global mean
    gradient = the mean of the groups' SGD steps."""
    layout = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2"]
    _, sync = _trainer(layout)
    _, local = _trainer([*layout, "train.local_steps=1", "train.outer_lr=1.0", "train.outer_momentum=0"])
    sgd = optax.sgd(optax.constant_schedule(0.5))  # a schedule: the step reports its lr from the count
    diloco = dataclasses.replace(local.diloco, inner=sgd)
    params = sync.init(jax.random.key(0)).params
    a = TrainState(np.int32(0), params, sgd.init(params))
    b = TrainState(np.int32(0), params, local.optimizer.init(params), None, outer.fresh_local(params, sgd, 2))
    sync_step = jax.jit(functools.partial(train_step, strategy=sync.strategy, optimizer=sgd, tc=sync.tc))
    local_step = jax.jit(diloco.step)
    with jax.set_mesh(sync.mesh):
        for seed in range(2):
            batch = random_batch(sync, seed)
            a, ma = sync_step(a, batch)
            b, mb = local_step(b, batch)
            assert float(mb["loss"]) == pytest.approx(float(ma["loss"]), rel=1e-5)
    assert not np.allclose(_embedding(a.params), _embedding(params))
    _close(b.params, a.params)


@pytest.fixture(scope="module")
def rounds():
    """dp2 x cp2 (ring attention inside each group), H=2: the state after each of two steps, and the groups
    after step 2's inner step alone."""
    cfg, trainer = _trainer(["mesh.dp=2", "mesh.cp=2", "mesh.tp=1", "train.local_steps=2", "train.warmup_steps=0"])
    host = functools.partial(jax.tree.map, np.asarray)  # the step donates its state: keep copies
    state, batches = trainer.init(jax.random.key(0)), [random_batch(trainer, s) for s in range(2)]
    states = [host(state)]
    state = trainer.step(state, batches[0])[0]
    states.append(host(state))
    with jax.set_mesh(trainer.mesh):
        inner_only = host(jax.jit(trainer.diloco.inner_step)(state.local, batches[1])[0])
    states.append(host(trainer.step(state, batches[1])[0]))
    return cfg, states, inner_only


def test_between_synchronisations_the_groups_drift_apart_and_the_global_parameters_wait(rounds):
    _, (s0, s1, _), _ = rounds
    _close(s1.params, s0.params, rtol=0, atol=0)
    g0, g1 = (jax.tree.map(lambda x, i=i: np.asarray(x)[i], s1.local["params"]) for i in range(2))
    start = jax.tree.map(np.asarray, s0.params)
    assert not np.allclose(_embedding(g0), _embedding(g1))  # each group stepped on its own rows
    assert not np.allclose(_embedding(g0), _embedding(start))


@pytest.mark.proves("ring+diloco")
def test_the_outer_nesterov_step_moves_the_global_parameters_by_the_groups_mean_delta(rounds):
    """First outer step: momentum m = delta, Nesterov's step lr * (delta + mu * m) = lr * (1 + mu) * delta,
    delta = global - mean over groups; then every group restarts from the new global parameters."""
    cfg, (_, s1, s2), inner_only = rounds
    lr, mu = cfg.train.outer_lr, cfg.train.outer_momentum
    mean = jax.tree.map(lambda x: np.asarray(x, np.float64).mean(axis=0), inner_only["params"])
    want = jax.tree.map(lambda p, m: np.asarray(p, np.float64) - lr * (1 + mu) * (np.asarray(p, np.float64) - m),
                        s1.params, mean)
    _close(s2.params, want, rtol=1e-5, atol=1e-6)
    for group in range(2):
        _close(jax.tree.map(lambda x: np.asarray(x)[group], s2.local["params"]), s2.params, rtol=0, atol=0)


def test_a_resume_continues_bit_for_bit_and_other_groups_restart_from_the_global_parameters(tmp_path, capfd):
    """dp2, H=2, saved at step 3 (mid-round: the groups hold one inner step the global parameters do not);
    resumed as it was, onto dp4, and onto interleaved pipelines (dp2 x pp2, 2 virtual stages: the groups'
    layers stored in another order)."""
    def run(name: str, *extra: str) -> list[float]:
        overrides = [*SMALL, "mesh.dp=2", "mesh.tp=1", "train.steps=4", "log.every=1", "log.eval_every=0",
                     "model.num_hidden_layers=4",
                     "train.local_steps=2", f"log.dir={tmp_path}/{name}", f"checkpoint.dir={tmp_path}/{name}/ckpt",
                     "checkpoint.every=3", *extra]
        cfg = load_config("debug", overrides)
        devices = jax.devices()[:cfg.mesh.dp * cfg.mesh.pp]
        return [r["loss"] for r in train(cfg, progress=False, devices=devices)]

    straight = run("a")

    preempted_after(tmp_path / "a", tmp_path / "b", 3)
    assert run("b") == straight[3:]
    assert "starts from the global parameters" not in capfd.readouterr().err
    preempted_after(tmp_path / "a", tmp_path / "c", 3)
    assert len(run("c", "mesh.dp=4")) == 1
    assert "every DiLoCo group starts from the global parameters" in capfd.readouterr().err
    preempted_after(tmp_path / "a", tmp_path / "d", 3)
    assert run("d", "mesh.pp=2", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2") == pytest.approx(
        straight[3:], rel=1e-5)
    assert "starts from the global parameters" not in capfd.readouterr().err
    preempted_after(tmp_path / "a", tmp_path / "e", 3)
    assert len(run("e", "train.diloco_groups=1")) == 1  # the same replicas in other groups
    assert "every DiLoCo group starts from the global parameters" in capfd.readouterr().err


# (payload, its overrides, the layout, ||carried - exact|| / ||exact|| must be below): int8 on a group of 1F1B
# pipelines; bf16 (2^-9 relative per value); PowerSGD at rank 2, held to its float64 rank-2 reference instead
# (test_grad_compression.powersgd_reference: ||carried - reference|| / ||reference|| below POWERSGD_RTOL, measured
# 4.8e-7, where the rank-2 mean is 0.72 of the exact one's norm away from it).
OUTER_PAYLOADS = [("int8", [], ["mesh.pp=2"], 0.02), ("bf16", [], [], 0.005),
                  ("powersgd", ["train.powersgd_rank=2"], [], None)]


@pytest.mark.parametrize("payload, extra, layout, bound", OUTER_PAYLOADS, ids=[p[0] for p in OUTER_PAYLOADS])
@pytest.mark.proves("int8_reduce+diloco", "bf16_reduce+diloco", "powersgd+diloco")
def test_a_compressed_outer_average_is_the_exact_one_within_its_payload_and_keeps_what_it_lost(payload, extra, layout,
                                                                                              bound):
    """dp2 (x pp2 for int8), H=1, `train.grad_compression` compresses the outer average under DiLoCo: the carried
    mean of (global - copy) is the exact one within the payload's rounding, the replicas' residuals hold the rest
    exactly, and (int8) the outer SGD (lr 1, no momentum) moves the global parameters by the carried mean."""
    _, trainer = _trainer(["mesh.dp=2", *layout, "mesh.tp=1", "train.local_steps=1", "train.outer_lr=1.0",
                           "train.outer_momentum=0", f"train.grad_compression={payload}", *extra,
                           "train.warmup_steps=0"])
    diloco, state, batch = trainer.diloco, trainer.init(jax.random.key(0)), random_batch(trainer)
    with jax.set_mesh(trainer.mesh):
        local = jax.jit(diloco.inner_step)(state.local, batch)[0]
        delta, residual = jax.jit(diloco.compressed_delta)(state.params, local["params"], state.residual)
    host = functools.partial(jax.tree.map, lambda x: np.asarray(x, np.float64))
    params, copies, delta, errors = host(state.params), host(local["params"]), host(delta), host(residual["error"])
    exact = jax.tree.map(lambda p, c: p - c.mean(axis=0), params, copies)
    _close(jax.tree.map(lambda d, e: 2 * d + e.sum(axis=0), delta, errors),
           jax.tree.map(lambda x: 2 * x, exact), rtol=1e-5, atol=1e-9)
    gap = np.sqrt(sum(np.sum((d - x) ** 2) for d, x in zip(jax.tree.leaves(delta), jax.tree.leaves(exact))))
    size = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(exact)))
    if payload == "powersgd":
        from test_grad_compression import POWERSGD_RTOL, powersgd_reference

        reference = powersgd_reference(trainer, exact, 2)
        off = np.sqrt(sum(np.sum((d - r) ** 2) for d, r in zip(jax.tree.leaves(delta), reference)))
        assert gap > 0 and off < POWERSGD_RTOL * np.sqrt(sum(np.sum(r ** 2) for r in reference)), (off, gap / size)
        return
    assert 0 < gap < bound * size
    if payload != "int8":  # the step's use of `compressed_delta` is one code path for every payload: compiled once
        return
    # The step is another program than the inner step's and `compressed_delta`'s (tests/closeness.py): its copies
    # differ in last bits, so a value on an int8 rounding boundary may land a quantum away in either phase. With
    # M a replica's largest |global - copy|, the mean moves by at most M / 254 (phase 1) + M / 127 (phase 2); 16
    # of a leaf's 98,304 entries moved, by 7.9e-6, under XLA:CPU's loop emitters (tests/conftest.py).
    new = host(trainer.step(state, batch)[0].params)
    for n, p, d, c in zip(*map(jax.tree.leaves, (new, params, delta, copies)), strict=True):
        assert_close_but_a_few(n, p - d, rtol=1e-6, atol=1e-9, bound=1.5 * np.abs(p - c).max() / 127, share=1e-3)


@pytest.mark.parametrize("size", [2, 4])
def test_a_group_sum_is_each_groups_exact_sum_on_every_replica_alike(size):
    """dp8: groups of `size` consecutive replicas, a leaf that does not split into `size` chunks evenly."""
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.random.normal(jax.random.key(0), (8, 3, 5))
    summed = jax.jit(jax.shard_map(lambda v: groups.group_sum(v, size), mesh=mesh, in_specs=P("dp"),
                                   out_specs=P("dp")))(jax.device_put(x, NamedSharding(mesh, P("dp"))))
    got, want = np.asarray(summed), np.asarray(x).reshape(8 // size, size, 3, 5).sum(axis=1)
    for replica in range(8):
        np.testing.assert_allclose(got[replica], want[replica // size], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[replica], got[replica - replica % size])  # bit for bit within a group


def test_groups_of_two_replicas_step_as_one_replica_with_their_rows():
    """dp4 in 2 groups against dp2 (a replica per group), one inner SGD step (H=2: no synchronisation yet): each
    group's replicas hold what the dp2 replica with the same rows holds, and alike to the bit."""
    overrides = ["mesh.tp=1", "train.local_steps=2"]
    sgd = optax.sgd(optax.constant_schedule(0.5))
    batch, after = None, []
    for layout in (["mesh.dp=4", "train.diloco_groups=2"], ["mesh.dp=2"]):
        _, trainer = _trainer([*layout, *overrides])
        batch = jax.tree.map(np.asarray, random_batch(trainer)) if batch is None else batch
        params = trainer.init(jax.random.key(0)).params
        replicas = trainer.mesh.shape["dp"]
        state = TrainState(np.int32(0), params, trainer.optimizer.init(params), None,
                           outer.fresh_local(params, sgd, replicas))
        with jax.set_mesh(trainer.mesh):
            new = jax.jit(dataclasses.replace(trainer.diloco, inner=sgd).step)(
                state, jax.device_put(batch, trainer.batch_sharding))[0]
        after.append(jax.tree.map(np.asarray, new.local["params"]))
    for replica in range(4):
        mine = jax.tree.map(lambda x: x[replica], after[0])
        _close(mine, jax.tree.map(lambda x: x[replica // 2], after[1]))
        _close(mine, jax.tree.map(lambda x: x[replica - replica % 2], after[0]), rtol=0, atol=0)
    assert not np.allclose(_embedding(jax.tree.map(lambda x: x[0], after[0])),
                           _embedding(jax.tree.map(lambda x: x[2], after[0])))


@pytest.mark.parametrize("outer_loop", [["mesh.dp=2", "train.local_steps=2"],
                                        ["mesh.dp=2", "train.local_steps=4", "train.diloco_fragments=2"],
                                        ["mesh.dp=4", "train.local_steps=2", "train.diloco_groups=2"]],
                         ids=["diloco", "streaming", "groups_of_2"])
@pytest.mark.proves("diloco+fp8", "streaming+fp8")
def test_with_fp8_each_group_steps_as_one_device_does_on_its_rows(outer_loop):
    """dp2 (or dp4 in groups of 2), fp8 GEMMs, one inner SGD step (no synchronisation yet; streaming: no fragment
    sent): each group's copy is what one device's (a group of 2: dp2's) fp8 step makes on the group's rows. A
    group's fp8 scales are its own: one shared over dp would be the amax of both groups' tensors; within a group
    an activation's amax spans its replicas' rows, and a weight's is any replica's own (their copies are one
    model, bit for bit). Against one device a group of 2 differs past rounding: its GEMMs see one row each, whose
    last-bit differences move some fp8 roundings."""
    _, grouped = _trainer(["mesh.tp=1", "precision.fp8=true", *outer_loop])
    per_group = grouped.mesh.shape["dp"] // 2
    _, single = _trainer([f"mesh.dp={per_group}", "mesh.tp=1", "precision.fp8=true", "train.batch_size=4"])
    sgd = optax.sgd(optax.constant_schedule(0.5))
    params = grouped.init(jax.random.key(0)).params
    batch = jax.tree.map(np.asarray, random_batch(grouped))
    replicas = grouped.mesh.shape["dp"]
    state = TrainState(np.int32(0), params, grouped.optimizer.init(params), None,
                       outer.fresh_local(params, sgd, replicas))
    jit = functools.partial(jax.jit, compiler_options=grouped.xla_options)  # XLA:CPU keeps every fp8 rounding
    with jax.set_mesh(grouped.mesh):
        on_mesh = jax.device_put(batch, grouped.batch_sharding)
        lowered = jit(dataclasses.replace(grouped.diloco, inner=sgd).step).lower(state, on_mesh)
        new = lowered.compile()(state, on_mesh)[0]
    assert "f8E5M2" in lowered.as_text()
    copies = jax.tree.map(np.asarray, new.local["params"])
    for replica in range(replicas):  # the copies of one group are one model
        _close(jax.tree.map(lambda x: x[replica], copies),
               jax.tree.map(lambda x: x[replica - replica % per_group], copies), rtol=0, atol=0)
    copies = jax.tree.map(lambda x: x[::per_group], copies)
    host = jax.tree.map(np.asarray, params)
    step = jit(functools.partial(train_step, strategy=single.strategy, optimizer=sgd, tc=single.tc))
    rows = batch["inputs"].shape[1] // 2
    with jax.set_mesh(single.mesh):
        for g in range(2):
            mine = jax.tree.map(lambda x: x[:, g * rows:(g + 1) * rows], batch)
            one = step(TrainState(np.int32(0), host, sgd.init(host)), mine)[0]
            _close(jax.tree.map(lambda x: x[g], copies), jax.tree.map(np.asarray, one.params))
    assert not np.allclose(_embedding(jax.tree.map(lambda x: x[0], copies)),
                           _embedding(jax.tree.map(lambda x: x[1], copies)))


@pytest.mark.parametrize("overrides, message", [
    (["mesh.dp=2", "train.grad_compression=powersgd", "train.powersgd_start=3"],
     "does not run with train.powersgd_start=3: use train.powersgd_start=0"),
    (["mesh.dp=4", "train.diloco_groups=3"], "the groups split the mesh.dp=4 replicas evenly; use a divisor of 4"),
])
def test_layouts_diloco_does_not_run_on_are_one_line(overrides, message):
    cfg = load_config("debug", ["train.local_steps=4", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_run(cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.context, cfg.precision)


def test_the_planner_counts_one_parameter_average_every_h_steps():
    from pjax.plan.estimate import analytic_comm
    from pjax.plan.layouts import Layout

    def link(*extra: str) -> float:
        cfg = load_config("picotron-cpu", ["train.grad_accum=2", *extra])
        return analytic_comm(cfg, Layout(dp=8, grad_accum=2), 4, 8)["dp"]["link_bytes"]

    assert link("train.local_steps=16") == pytest.approx(link() / 16)
    assert link("train.local_steps=16", "train.grad_compression=bf16") == pytest.approx(link() / 32)
    # groups of 4 replicas sum each step's gradient on a ring of 4: 2 * 3/4 of it against dp8's 2 * 7/8
    assert link("train.local_steps=16", "train.diloco_groups=2") == pytest.approx(link() * (1 / 16 + 6 / 7))


def test_a_resume_across_optimizer_trees_is_one_line_naming_the_keys():
    """DiLoCo's outer SGD state cannot continue AdamW's (nor Reptile's); a new clip value or outer lr can."""
    from pjax.checkpoint.checkpointer import check_compatible

    plain = load_config("debug", [])
    diloco = load_config("debug", ["train.local_steps=4"])
    with pytest.raises(ConfigError, match=r"train.local_steps=4 \(checkpoint: 0\)"):
        check_compatible(plain, diloco, "here")
    with pytest.raises(ConfigError, match=r"train.outer_momentum=0.0 \(checkpoint: 0.9\)"):
        check_compatible(diloco, load_config("debug", ["train.local_steps=4", "train.outer_momentum=0"]), "here")
    check_compatible(diloco, load_config("debug", ["train.local_steps=8", "train.grad_clip=0.5",
                                                   "train.outer_lr=0.3"]), "here")
