"""XLA:GPU on a host without a GPU (pjax/plan/gpu_target.py): the planner compiles a layout's step for
compile-only H100s and reads XLA:GPU's memory plan and collectives; without the plugin it says so in one line."""
import dataclasses
import json

import pytest

from mesh.backend import building_for, target_backend
from mesh.mesh import make_mesh
from pjax import cudnn_fallback
from pjax.config_io import load_config
from pjax.plan import __main__ as plan_cli
from pjax.plan import gpu_target
from pjax.plan.compile import compile_planned
from pjax.plan.inspect import step_collectives
from pjax.plan.layouts import Layout, planned_config
from pjax.plan.profiles import PROFILES
from pjax.step import build_trainer

LAYOUT = Layout.parse("dp4-tp2-zero1")


@pytest.fixture(scope="module")
def compiled():
    """debug's dp4 x tp2 ZeRO-1 step compiled once by XLA:GPU for 8 compile-only H100s the way `pjax.train`
    compiles (`cudnn_fallback.compile_step`, train.attention=auto), and once by XLA:CPU."""
    assert gpu_target.unavailable_reason() is None, gpu_target.unavailable_reason()
    config = load_config("debug", [])
    cfg = planned_config(config, LAYOUT, PROFILES["h100"])
    mesh = make_mesh(cfg.mesh, gpu_target.gpu_devices("h100", 8, 8))
    build = lambda tc: build_trainer(mesh, cfg.model, tc, cfg.pipeline, cfg.moe, cfg.context)
    with building_for("gpu"), gpu_target.persistent_cache(False):
        gpu = cudnn_fallback.compile_step(build(dataclasses.replace(cfg.train, attention="auto")), build)
    return {"gpu": gpu, "cpu": compile_planned(config, LAYOUT, PROFILES["h100"], 8, "cpu"), "config": cfg}


def test_the_step_is_compiled_by_xla_gpu_for_the_kind_s_devices(compiled):
    trainer, step, _ = compiled["gpu"]
    kinds = {d.device_kind for d in trainer.mesh.devices.flat}
    assert kinds == {"NVIDIA H100 80GB HBM3"} and trainer.mesh.devices.size == 8
    hlo = step.as_text()
    # XLA:GPU's form: collectives as async start/done pairs, GEMMs as fusions or cuBLAS calls
    assert "all-reduce-start" in hlo or "reduce-scatter-start" in hlo or "all-gather-start" in hlo
    assert "__cublas" in hlo or "gemm_fusion" in hlo
    assert "all-reduce-start" not in compiled["cpu"][2].as_text()


def test_pjax_train_s_compile_falls_back_to_chunked_attention_in_one_line(compiled):
    """jax 0.10.2's partitioner of cuDNN's attention fails inside the dp shard_map on several devices."""
    trainer, step, warning = compiled["gpu"]
    assert trainer.tc.attention == "chunked" and "__cudnn$fmha" not in step.as_text()
    assert warning.startswith("warning: cuDNN's attention (train.attention=auto) did not compile for this layout (")
    assert len(warning.splitlines()) == 1 and warning.endswith("training with train.attention=chunked, the same "
                                                               "memory without cuDNN's kernel.")


def test_one_gpu_compiles_cudnn_attention_the_kernel_pjax_train_runs():
    assert gpu_target.cudnn_reason() is None, gpu_target.cudnn_reason()
    profile = gpu_target.planned_profile(PROFILES["h100"], "gpu")
    cfg, _, step = compile_planned(load_config("debug", []), Layout.parse("1"), profile, 8, "gpu")
    assert cfg.train.attention == "cudnn" and "__cudnn$fmha" in step.as_text()


def test_the_same_state_with_the_gpu_s_own_memory_plan(compiled):
    gpu, cpu = (compiled[b][i].memory_analysis() for b, i in (("gpu", 1), ("cpu", 2)))
    assert gpu.argument_size_in_bytes == cpu.argument_size_in_bytes  # parameters, moments, batch: the same shards
    assert gpu.temp_size_in_bytes > 0 and gpu.temp_size_in_bytes != cpu.temp_size_in_bytes


def test_the_planner_reads_collectives_per_axis_from_the_gpu_compile(compiled):
    trainer, step, _ = compiled["gpu"]
    comm = step_collectives(compiled["config"], dict(trainer.mesh.shape), step.as_text(), 8)
    assert {"dp", "tp"} <= set(comm)
    assert "reduce-scatter" in comm["dp"]["kinds"]  # ZeRO-1: the gradient in dp slices


def test_building_for_gpu_is_scoped_to_the_block():
    assert target_backend() == "cpu"
    with building_for("gpu"):
        assert target_backend() == "gpu"
    assert target_backend() == "cpu"


def test_explain_says_which_compiler_and_a_cpu_kind_cannot_ask_for_xla_gpu(capsys):
    assert plan_cli.main(["--config", "debug", "--devices", "8", "--device-kind", "h100",
                          "--explain", "dp4-tp2-zero1"]) == 0
    assert "dp4-tp2-zero1-m1 on 8 h100, compiled by XLA:GPU" in capsys.readouterr().out
    assert plan_cli.main(["--config", "debug", "--devices", "8", "--device-kind", "cpu", "--xla", "gpu",
                          "--explain", "dp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device-kind cpu is not one of them" in err


def test_without_the_plugin_the_planner_falls_back_to_xla_cpu_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(gpu_target, "unavailable_reason", lambda: "XLA:GPU cannot compile here (no plugin)")
    assert gpu_target.resolve_backend("auto", "h100") == "cpu"
    assert plan_cli.main(["--config", "debug", "--devices", "8", "--device-kind", "h100", "--xla", "gpu",
                          "--explain", "dp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no plugin" in err and "--xla cpu" in err


def test_a_gpu_plan_runs_what_it_compiled(capsys, tmp_path):
    assert plan_cli.main(["--config", "debug", "--devices", "8", "--device-kind", "h100", "--max-candidates", "2",
                          "--workers", "0", "--cache", str(tmp_path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["compiler"] == "xla:gpu" and len(plan["compiled"]) == 2
    for c in plan["compiled"]:  # cuDNN's attention where it compiled, else chunked, and the command says which
        assert c["attention"] in ("cudnn", "chunked") and c["memory"]["total"] > c["memory"]["argument"]
        assert ("train.attention=chunked" in c["overrides"]) == (c["attention"] == "chunked")
