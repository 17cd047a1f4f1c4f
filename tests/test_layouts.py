"""The layout search space (pjax/plan/layouts.py): every listed layout is one pjax accepts, its overrides
give that layout back, and the analytic state per device is what XLA's compiled step holds."""
import jax
import numpy as np
import pytest

from mesh import make_mesh
from pjax.config_io import load_config
from pjax.plan.layouts import Layout, layouts, mesh_shapes, state_bytes
from pjax.step import build_trainer


def test_mesh_shapes_cover_every_factorisation_with_tp_inside_a_host():
    shapes = list(mesh_shapes(16, devices_per_host=8))
    assert len(shapes) == len(set(shapes))
    assert all(np.prod(s) == 16 for s in shapes)
    assert max(s[3] for s in shapes) == 8  # tp=16 would span two hosts
    # all ordered factorisations of 16 = 2^4 into 4 factors: C(4+3, 3) = 35, minus the one with tp = 16
    assert len(shapes) == 34


def test_listed_layouts_are_exactly_those_pjax_accepts_and_their_overrides_give_them_back():
    config = load_config("llama2-7b")  # 32 heads and kv-heads, 32 layers, batch 256 in 4 micro-batches
    found = layouts(config, devices=8, devices_per_host=8)
    names = {layout.name for layout in found}
    assert "dp8-m4" in names and "dp2-tp4-zero1-m4" in names and "pp2-tp4-remat-m4" in names
    assert "pp2-tp4-interleaved2-m4" in names and "dp8-m32" in names and "dp8-m64" not in names  # 256 rows over dp8
    assert "pp8-m4" in names and "pp8-interleaved2-m4" not in names  # interleaving needs m in groups of pp
    assert {"dp4-pp2-zb_h1-m4", "pp8-zb_v-m4", "pp2-tp4-sp-zb_v-m4"} <= names  # zb_v: 32 layers in 2 x 8 chunks
    assert {"dp2-pp2-cp2-zb_h1-m4", "dp2-pp2-cp2-zb_v-m4"} <= names  # zero-bubble in lockstep with cp > 1
    for name in ("pp2-zb_h1-m4", "pp4-zb_v-m8"):
        assert Layout.parse(name).name == name
    assert Layout.parse("pp4-zb_v-m8").virtual_stages == 2
    assert load_config("llama2-7b", Layout.parse("pp4-zb_v-m8").overrides()).pipeline.schedule == "zb_v"
    assert len(names) == len(found)
    for layout in found[::7]:
        again = load_config("llama2-7b", layout.overrides())
        assert again.mesh == layout.mesh and again.train.zero == layout.zero and again.train.remat == layout.remat
        assert again.train.grad_accum == layout.grad_accum and Layout.parse(layout.name) == layout
        assert again.train.zero_shard == layout.zero_shard
    # heads 9 / kv-heads 3 (SmolLM2-135M): no tp of 2, 4 or 8
    assert {layout.tp for layout in layouts(load_config("smollm-135m"), 8, 8)} == {1}


def test_an_moe_model_s_layouts_try_every_ep_the_experts_allow_and_name_it():
    config = load_config("mixtral-8x7b")  # 8 experts; tp 8 leaves dp 16 on 128 devices
    found = [layout for layout in layouts(config, devices=128, devices_per_host=8, zeros=(1,), remats=("full",))
             if layout.tp == 8 and layout.pp == 1 and layout.cp == 1]
    assert {layout.ep for layout in found} == {1, 2, 4, 8}  # 16 does not divide 8 experts
    name = next(layout.name for layout in found if layout.ep == 8 and layout.grad_accum == 8)
    assert name == "dp16-ep8-tp8-zero1-remat-m8" and Layout.parse(name).ep == 8
    assert load_config("mixtral-8x7b", Layout.parse(name).overrides()).mesh.ep == 8
    assert {layout.ep for layout in layouts(load_config("llama2-7b"), 8, 8)} == {0}  # dense: no ep to choose


MOE = ["model.num_local_experts=4", "model.num_experts_per_tok=2"]


@pytest.mark.parametrize("layout,model", [(Layout(dp=8), []), (Layout(dp=4, tp=2, zero=1), []),
                                          (Layout(dp=4, pp=2, zero=3), []), (Layout(dp=8, zero=1, ep=2), MOE)],
                         ids=["dp8-m1", "dp4-tp2-zero1-m1", "dp4-pp2-zero3-m1", "dp8-ep2-zero1-moe"])
def test_state_bytes_equal_what_the_compiled_step_holds(layout, model):
    """Arguments of the compiled step = parameters + optimizer state + the batch + a few scalars; an MoE model's
    experts half of them on each device at ep 2, copied over dp's 4 replicas of the group."""
    config = load_config("debug", [*model, *layout.overrides()])
    analytic = state_bytes(config, layout)
    trainer = build_trainer(make_mesh(config.mesh, jax.devices()[:8], config.model.num_local_experts), config.model,
                            config.train, config.pipeline)
    arguments = trainer.compile_step().memory_analysis().argument_size_in_bytes
    tc = config.train
    batch = 3 * tc.batch_size // layout.dp * tc.seq_len * 4  # inputs, labels, positions: int32, rows over dp
    scalars = arguments - batch - analytic["params"] - analytic["opt_state"]
    assert 0 <= scalars <= 64, scalars  # the step counter and the optimizer's counts
    assert analytic["grads"] * 2 == analytic["opt_state"]
    if layout.zero == 0:
        assert analytic["grads"] == analytic["params"]
