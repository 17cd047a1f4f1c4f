"""HSDP (`train.zero_shard=N`): ZeRO-1 and ZeRO-3 shard their state over groups of N consecutive data replicas and
copy it across the groups. Every layout equals one device; the compiled step's collectives stay inside a group but
for all-reduces, and under ZeRO-1 the bytes that cross groups per step are exactly 1/N of the gradient's."""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

import proofs
from mesh import ConfigError, MeshConfig, make_mesh
from models.precision import PrecisionConfig
from pjax.config import PipelineConfig
from pjax.config_io import load_config
from pjax.observe import hlo
from pjax.parallel import data_parallel
from pjax.parallel.context.strategy import ContextConfig
from pjax.parallel.context.zigzag import zigzag_layout
from pjax.parallel.pipeline import layout as ppl
from pjax.step import build_trainer, mesh_for
from pjax.validate import validate_run
from test_step import CFG, TC, assert_grads_close, make_batch


@proofs.cache
def hsdp_trainer(dp: int, zero: int, shard: int, tp: int = 1, pp: int = 1, cp: int = 1, layers: int = 2,
                 schedule: str = "1f1b", context: str = "ring", sp: bool = False, grad_accum: int = 2,
                 fp8: bool = False):
    mesh = make_mesh(MeshConfig(dp=dp, tp=tp, pp=pp, cp=cp), jax.devices()[:dp * tp * pp * cp], zero_shard=shard)
    tc = dataclasses.replace(TC, zero=zero, zero_shard=shard, grad_accum=grad_accum, sequence_parallel=sp)
    pipeline = PipelineConfig(schedule=schedule, virtual_stages=2 if schedule in ("interleaved", "zb_v") else 1)
    return build_trainer(mesh, dataclasses.replace(CFG, num_hidden_layers=layers), tc, pipeline,
                         context=ContextConfig(strategy=context), precision=PrecisionConfig(fp8=fp8 or None))


@functools.cache
def one_device_params(layers: int):
    return jax.tree.map(np.asarray, hsdp_trainer(1, 0, 0, layers=layers).init(jax.random.key(0)).params)


def loss_and_grads_of(trainer):
    """The trainer's loss and gradients (model layer order) on the test batch (zigzag columns under cp), from
    one device's initial parameters."""
    order = trainer.mesh.shape["pp"], trainer.pipeline.virtual_stages if trainer.pipeline else 1, \
        bool(trainer.pipeline and trainer.pipeline.vshape)
    params = ppl.to_pipeline_layout(one_device_params(trainer.cfg.num_hidden_layers), *order)
    cols = np.asarray(zigzag_layout(trainer.mesh.shape["cp"])(np.arange(TC.seq_len)))
    batch = jax.tree.map(lambda a: np.asarray(a)[..., cols], make_batch(2, 16))
    with jax.set_mesh(trainer.mesh):
        loss, grads = trainer.grads(jax.device_put(params, trainer.state_sharding.params),
                                    jax.device_put(batch, trainer.batch_sharding))
    return float(loss), ppl.to_model_layout(jax.tree.map(np.asarray, grads), *order)


# 2 groups of 4 and 4 groups of 2 over dp 8; groups of 2 inside dp 4 with each other axis: tp (with sequence
# parallelism), each pipeline schedule, ring and all-gather context parallelism (Ulysses: tests/test_composition.py);
# ZeRO-1 and ZeRO-3 alternating.
@pytest.mark.parametrize("layout", [
    pytest.param(dict(dp=8, zero=3, shard=4), id="dp8_zero3_groups_of_4"),
    pytest.param(dict(dp=8, zero=1, shard=2), id="dp8_zero1_groups_of_2"),
    pytest.param(dict(dp=4, tp=2, sp=True, zero=3, shard=2), id="dp4_tp2_sp_zero3",
                 marks=pytest.mark.proves("sp+hsdp")),
    pytest.param(dict(dp=4, pp=2, zero=1, shard=2), id="dp4_pp2_1f1b_zero1", marks=pytest.mark.proves("1f1b+hsdp")),
    pytest.param(dict(dp=4, pp=2, schedule="zb_h1", zero=3, shard=2), id="dp4_pp2_zb_h1_zero3",
                 marks=pytest.mark.proves("zb_h1+hsdp")),
    pytest.param(dict(dp=4, pp=2, layers=4, schedule="interleaved", zero=1, shard=2), id="dp4_pp2_interleaved_zero1",
                 marks=pytest.mark.proves("interleaved+hsdp")),
    pytest.param(dict(dp=4, pp=2, layers=4, schedule="zb_v", zero=3, shard=2), id="dp4_pp2_zb_v_zero3",
                 marks=pytest.mark.proves("zb_v+hsdp")),
    pytest.param(dict(dp=4, cp=2, zero=1, shard=2), id="dp4_cp2_ring_zero1", marks=pytest.mark.proves("ring+hsdp")),
    pytest.param(dict(dp=4, cp=2, context="all_gather", zero=3, shard=2), id="dp4_cp2_all_gather_zero3",
                 marks=pytest.mark.proves("all_gather+hsdp")),
])
def test_hsdp_loss_and_grads_equal_one_device(layout):
    trainer = hsdp_trainer(**layout)
    assert trainer.mesh.shape["rp"] == layout["dp"] // layout["shard"] > 1
    ref_loss, ref_grads = loss_and_grads_of(hsdp_trainer(1, 0, 0, layers=trainer.cfg.num_hidden_layers))
    loss, grads = loss_and_grads_of(trainer)
    assert abs(loss - ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads)
    # ZeRO's state lives as the rule says: 'embed' over the group (dp x ep), copied over rp.
    spec = data_parallel.grad_shardings(trainer.mesh, trainer.cfg, trainer.tc.zero)["embed"]["embedding"].spec
    assert spec[-1] == ("dp", "ep") and "rp" not in str(spec)


@pytest.mark.proves("hsdp+fp8")
def test_with_fp8_gemms_hsdp_steps_as_flat_zero3_does():
    """dp 4, three AdamW steps with fp8 GEMMs: groups of 2 give flat ZeRO-3's losses. (Against one device fp8 at dp 4
    drifts past rounding whatever the ZeRO layout: a sum's last bit moves an e5m2 rounding now and then, and later
    roundings amplify it; tests/test_composition.py says so for its fp8 runs.)"""
    runs = []
    for shard in (2, 0):
        trainer = hsdp_trainer(4, 3, shard, fp8=True)
        state = trainer.init(jax.random.key(0))
        losses = []
        for seed in range(3):
            state, metrics = trainer.step(state, jax.device_put(make_batch(2, 16, seed), trainer.batch_sharding))
            losses.append(float(metrics["loss"]))
        runs.append(losses)
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)
    assert runs[0][2] != runs[0][0]


def _crossing(trainer) -> dict[str, dict]:
    """The compiled step's collectives per set of mesh axes, rp kept apart from dp (`merge=False`)."""
    text = trainer.compile_step().as_text()
    return hlo.collectives_by_axis(text, dict(trainer.mesh.shape), merge=False)


def test_only_all_reduces_cross_a_shard_group_and_zero1_sends_1_over_n_of_the_gradient_across():
    """dp 8 in 2 groups of 4. ZeRO-1: inside a group the gradient's reduce-scatter and the parameters' all-gather;
    across, one all-reduce of the group's 1/4 shard (the fp32 gradient's bytes / 4) and one of the loss and token
    count. ZeRO-3 (one micro-batch): the per-layer all-gathers and the gradients' reductions inside groups, only
    all-reduces across."""
    by_axes = _crossing(hsdp_trainer(8, 1, 4))
    across = {axes: row for axes, row in by_axes.items() if "rp" in axes and row["count"]}
    assert set(across) == {"rp", "rp+dp"}
    assert across["rp"]["kinds"] == {"all-reduce": 1} and across["rp"]["bytes"] == CFG.num_params * 4 // 4
    assert across["rp+dp"]["kinds"] == {"all-reduce": 1} and across["rp+dp"]["bytes"] == 8  # loss, tokens
    assert {"reduce-scatter", "all-gather"} <= set(by_axes["dp"]["kinds"])
    by_axes = _crossing(hsdp_trainer(8, 3, 4, grad_accum=1))
    kinds = {kind for axes, row in by_axes.items() if "rp" in axes for kind, n in row["kinds"].items() if n}
    assert kinds == {"all-reduce"}
    assert by_axes["dp"]["kinds"].get("all-gather", 0) > 0


def _refusal(overrides: list[str]) -> str:
    cfg = load_config("debug", overrides)
    with pytest.raises(ConfigError) as caught:
        validate_run(cfg.mesh, cfg.model, cfg.train, cfg.pipeline, cfg.context, cfg.precision, cfg.meta, cfg.moe)
    return str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.dp=8", "mesh.tp=1", "train.zero=3", "train.zero_shard=3"],
     "mesh.dp=8 does not split into groups of 3; use a divisor of 8"),
    (["mesh.dp=4", "mesh.tp=2", "train.zero=1", "train.zero_shard=2", "train.local_steps=2"],
     "does not run with train.local_steps=2 \\(DiLoCo\\); use train.diloco_groups"),
    (["mesh.dp=4", "mesh.tp=2", "train.zero=1", "train.zero_shard=2", "train.grad_compression=int8"],
     "does not run with train.grad_compression=int8"),
])
def test_shard_groups_that_cannot_split_the_run_are_one_line(overrides, message):
    assert re.search(message, _refusal(overrides))


def test_a_shard_group_never_cuts_an_expert_group_and_needs_zero():
    assert "would cut the expert groups of mesh.ep=4" in _refusal(["mesh.dp=8", "mesh.tp=1", "train.zero=1",
                                                                   "mesh.ep=4", "model.num_local_experts=8",
                                                                   "train.zero_shard=2"])
    unset = load_config("debug", ["mesh.dp=8", "mesh.tp=1", "train.zero=1", "model.num_local_experts=8",
                                  "train.zero_shard=2"])
    assert dict(mesh_for(unset).shape)["ep"] == 2  # an unset ep stays within the group
    with pytest.raises(ConfigError, match="it applies only with train.zero=1 or 3"):
        load_config("debug", ["train.zero_shard=2"])


def test_the_mesh_a_run_builds_has_its_groups_and_a_mismatched_one_is_one_line():
    cfg = load_config("debug", ["mesh.dp=8", "mesh.tp=1", "train.zero=3", "train.zero_shard=2"])
    assert dict(mesh_for(cfg).shape)["rp"] == 4
    with pytest.raises(ConfigError, match="asks for 4 ZeRO group\\(s\\), and the mesh has 1"):
        build_trainer(make_mesh(cfg.mesh), CFG, dataclasses.replace(TC, zero=3, zero_shard=2))
