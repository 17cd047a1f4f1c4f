"""XLA:GPU on a host without a GPU (pjax/plan/gpu_target.py): steps compiled for compile-only H100s, read for
their kernels. cuDNN's fused attention in every layout family, fp8 GEMMs that are fp8, pjax's XLA:GPU options
and the overlap they give, and the planner compiling what `pjax.train` runs. Skipped, with the reason printed,
where JAX's CUDA plugin cannot compile here (`pip install -e '.[gpu-plan]'`, part of the `test` extra)."""
import dataclasses
import functools
import json
import math
import os
import re

import pytest

from mesh.backend import building_for, target_backend
from mesh.errors import ConfigError
from mesh.mesh import make_mesh
from pjax import cudnn_fallback, xla_options
from pjax.config_io import load_config
from pjax.observe.hlo import async_overlap, async_spans, walk
from pjax.observe.hlo_flops import StepMatmuls, fused_attention, gemm_sites, scoped_gemm_flops
from pjax.plan import __main__ as plan_cli
from pjax.plan import gpu_target
from pjax.plan.compile import compile_layout, compile_planned
from pjax.plan.estimate import predict, reduced_gradient_bytes
from pjax.plan.inspect import step_collectives, step_part_runs
from pjax.plan.layouts import Layout, planned_config
from pjax.plan.profiles import PROFILES
from pjax.step import trainer_for

if gpu_target.unavailable_reason() is not None:
    # Where CI runs, the plugin is installed (.ci/run): its absence is a broken install, not a reason to skip every
    # GPU claim (fp8 GEMMs, cuDNN in every layout, pjax's XLA options) from a green run.
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(f"CI is set and {gpu_target.unavailable_reason()}")
    pytest.skip(gpu_target.unavailable_reason(), allow_module_level=True)

# The debug model with heads tp = 4 divides and four layers an interleaved pipeline of two stages splits.
SMALL = ["precision.preset=bf16", "model.num_attention_heads=8", "model.num_key_value_heads=4",
         "model.num_hidden_layers=4"]
# Stacked weights past pjax's combine thresholds, as a real model's are: one collective each to overlap.
WIDE = ["precision.preset=bf16", "model.hidden_size=4096", "model.intermediate_size=11008",
        "model.num_attention_heads=32", "model.num_key_value_heads=8"]


CUDNN_H100 = gpu_target.planned_profile(PROFILES["h100"], "gpu")  # cuDNN's attention, as pjax.train asks for it


def gpu_compile(config: str, overrides: list[str], layout: str, devices_per_host: int = 8):
    """(config as compiled, trainer, compiled step) of `layout` for compile-only H100s, compiled as the planner and
    `pjax.train` compile it (`compile_planned`: every config section, pjax's XLA options, the cuDNN guard, whose
    fallback would leave train.attention=chunked in the config)."""
    return compile_planned(load_config(config, overrides), Layout.parse(layout), CUDNN_H100, devices_per_host, "gpu")


def per_step(hlo_text: str, marker: str) -> float:
    """How many times per step the compiled step runs the instructions whose line holds `marker`: each loop body's
    as often as its known trip count says (not the text's count, which a loop's unrolling changes)."""
    found: dict[str, int] = {}

    def on_instr(comp: str, name: str, result: str, opcode: str, rest: str, line: str) -> None:
        if marker in line:
            found[comp] = found.get(comp, 0) + 1

    runs = walk(hlo_text, on_instr)
    return sum(n * runs.get(comp, 0) for comp, n in found.items())


LAYOUT = Layout.parse("dp4-tp2-zero1")


@pytest.fixture(scope="module")
def compiled():
    """debug's dp4 x tp2 ZeRO-1 step compiled by XLA:GPU for 8 compile-only H100s, and once by XLA:CPU."""
    config = load_config("debug", [])
    return {"gpu": gpu_compile("debug", [], "dp4-tp2-zero1")[1:],
            "cpu": compile_planned(config, LAYOUT, PROFILES["h100"], 8, "cpu"), "config": config}


def test_the_step_is_compiled_by_xla_gpu_for_the_kind_s_devices(compiled):
    trainer, step = compiled["gpu"]
    kinds = {d.device_kind for d in trainer.mesh.devices.flat}
    assert kinds == {"NVIDIA H100 80GB HBM3"} and trainer.mesh.devices.size == 8
    hlo = step.as_text()
    # XLA:GPU's form: collectives as async start/done pairs, GEMMs as cuBLAS calls (pjax's options: no Triton GEMMs)
    assert "all-reduce-start" in hlo or "reduce-scatter-start" in hlo or "all-gather-start" in hlo
    assert "__cublas$lt$matmul" in hlo and "__triton_nested_gemm_fusion" not in hlo
    assert "all-reduce-start" not in compiled["cpu"][2].as_text()


# Every layout family pjax ships, each the smallest that proves it: (config, overrides, layout, devices per host).
# Sequence parallelism with micro-batches: XLA:GPU's collective pipeliner ran each micro-batch's forward twice
# there (pjax/spec.py's barrier) and, under ZeRO-3, left the micro-batch loop without a known trip count
# (tests/test_hlo.py reads such a loop).
FAMILIES = {
    "dp8": ("debug", SMALL, "dp8", 8),
    "dp8-zero1": ("debug", SMALL, "dp8-zero1", 8),
    "dp8-zero3": ("debug", SMALL, "dp8-zero3", 8),
    "dp2-tp4": ("debug", SMALL, "dp2-tp4", 8),
    "dp2-tp4-sp": ("debug", SMALL, "dp2-tp4-sp-m2", 8),
    "dp4-tp2-zero3-sp": ("debug", SMALL, "dp4-tp2-zero3-sp-m2", 8),
    "dp4-pp2-1f1b": ("debug", SMALL, "dp4-pp2-m4", 8),
    "dp4-pp2-zb_h1": ("debug", SMALL, "dp4-pp2-zb_h1-m4", 8),
    "dp4-pp2-interleaved": ("debug", SMALL, "dp4-pp2-interleaved2-m4", 8),
    "dp4-cp2-ulysses": ("debug", SMALL, "dp4-cp2-ulysses", 8),
    "mixtral-dp4-tp2": ("mixtral-tiny", ["precision.preset=bf16"], "dp4-tp2", 8),
    "64-dp16-tp4-sp": ("debug", SMALL + ["train.batch_size=64"], "dp16-tp4-sp", 8),  # 8 hosts of 8
}


@pytest.mark.parametrize("family", FAMILIES)
def test_cudnn_attention_compiles_in_every_layout_family(family):
    """Forward and backward of every layer run cuDNN's fused attention, with no fallback (inside a data-parallel
    or pipeline region the attention runs manual over every mesh axis: models/attention.py), and each runs once
    per layer and micro-batch on a device: a stage's layers in a pipeline, its tick parts counted as often as its
    table runs them (`inspect.step_part_runs`)."""
    config, overrides, layout, per_host = FAMILIES[family]
    cfg, trainer, step = gpu_compile(config, overrides, layout, per_host)
    assert cfg.train.attention == "cudnn"  # no fallback to chunked
    calls = fused_attention(step.as_text(), step_part_runs(cfg))
    layers = trainer.cfg.num_hidden_layers // trainer.mesh.shape["pp"]
    assert calls == {"forward": layers * trainer.tc.grad_accum, "backward": layers * trainer.tc.grad_accum}, calls


# Every shipped remat policy on one GPU, and two in regions manual over some axes (dp's, a pipeline's).
REMATS = {"1-" + (f"remat_{r}-" if r != "full" else "remat-") + "m2": 2 if r == "full" else 1
          for r in ("dots", "dots_no_batch", "names", "offload", "full")}
REMATS |= {"dp8-zero1-remat_names-m2": 1, "dp4-pp2-remat_dots_no_batch-m4": 1}


@pytest.mark.parametrize("layout", REMATS)
def test_no_remat_policy_but_full_runs_cudnn_s_forward_again(layout):
    """cuDNN's output and log-sum-exp are tagged (`attention.keeping_residuals`), so every policy but `full` keeps
    them: each layer's forward runs once per micro-batch (untagged, the backward ran it again under all of them);
    `full` recomputes the whole layer, cuDNN's call once more."""
    cfg, trainer, step = gpu_compile("debug", SMALL + ["train.batch_size=32"], layout)
    assert cfg.train.attention == "cudnn" and cfg.train.remat != "none"
    calls = fused_attention(step.as_text(), step_part_runs(cfg))
    per_step = trainer.cfg.num_hidden_layers // trainer.mesh.shape["pp"] * trainer.tc.grad_accum
    assert calls == {"forward": REMATS[layout] * per_step, "backward": per_step}, calls


def test_a_head_dim_cudnn_does_not_take_here_runs_chunked_not_unfused():
    """A head dim of 256 (cuDNN's limit on Hopper, as JAX reads it only where its backend is that GPU: 128 on this
    host) compiles the chunked attention: no cuDNN call, its per-chunk einsum, and none of jax.nn's unfused
    form (`BTNH,BSNH->BNTS`: every query's scores against every key)."""
    cfg, trainer, step = gpu_compile("debug", SMALL + ["model.head_dim=256", "train.seq_len=1024"], "1")
    assert cfg.train.attention == "cudnn"
    hlo = step.as_text()
    assert fused_attention(hlo) == {"forward": 0, "backward": 0}
    assert "bckgd,bskd->bkgcs" in hlo and "BTNH,BSNH->BNTS" not in hlo


def test_ring_and_all_gather_keep_their_own_kernel_and_say_so():
    """Their per-device attention folds partial softmaxes (an online softmax over K/V chunks), which needs each
    chunk's softmax statistics; JAX's cuDNN call returns none, so only Ulysses (whole sequences per head group)
    runs cuDNN's kernel under cp: the planner compiles ring and all_gather with attention auto, and asking them
    for cuDNN's is one line."""
    for layout, kernel in (("dp4-cp2", "auto"), ("dp4-cp2-all_gather", "auto"), ("dp4-cp2-ulysses", "cudnn")):
        assert planned_config(load_config("debug", SMALL), Layout.parse(layout), CUDNN_H100).train.attention == kernel
    asked = load_config("debug", SMALL + ["mesh.dp=4", "mesh.cp=2", "mesh.tp=1", "train.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"context.strategy=ring \(its own online softmax\)"):
        trainer_for(make_mesh(asked.mesh, gpu_target.gpu_devices("h100", 8, 8)), asked)


def test_the_fallback_is_a_guard_whose_one_line_names_the_reason(monkeypatch):
    class Trainer:
        def __init__(self, attention):
            self.tc = dataclasses.replace(load_config("debug", []).train, attention=attention)

        def abstract_batch(self, seq_len=None):
            return None

        def compile_step(self, batch=None):
            if self.tc.attention != "chunked":
                raise RuntimeError("INTERNAL: custom_partitioner: cuDNN said no\nmore lines")
            return "compiled"

    with building_for("gpu"):
        trainer, step, warning = cudnn_fallback.compile_step(Trainer("auto"), lambda tc: Trainer(tc.attention))
    assert trainer.tc.attention == "chunked" and step == "compiled" and len(warning.splitlines()) == 1
    assert "(RuntimeError: INTERNAL: custom_partitioner: cuDNN said no)" in warning
    with pytest.raises(RuntimeError, match="cuDNN said no"):  # on XLA:CPU there is nothing to fall back from
        cudnn_fallback.compile_step(Trainer("auto"), lambda tc: Trainer(tc.attention))


SITES = ("qkv", "o", "gate_up", "down")


@functools.cache
def fp8_sites(config: str, layout: str) -> tuple[tuple[str, str], ...]:
    overrides = ["precision.preset=fp8"] + (SMALL[1:] if config == "debug" else [])
    cfg, _, step = gpu_compile(config, overrides, layout)
    assert cfg.train.attention == "cudnn"
    return tuple(gemm_sites(step.as_text()))


@pytest.mark.parametrize("layout", ["1", "dp2-tp4-sp", "dp4-pp2-zb_h1-m4"])
def test_fp8_runs_each_projection_s_three_gemms_in_fp8(layout):
    """Under precision.preset=fp8 the forward GEMM and both backward ones (dX, dW) of every projection read
    fp8 operands: plain autodiff (1 device), sequence parallelism's hand-written backward, zero-bubble's W items."""
    sites = fp8_sites("debug", layout)
    for site in SITES:
        gemms = [(kind, name) for kind, name in sites if f"/{site}/" in name]
        assert gemms and all(kind == "fp8" for kind, _ in gemms), (site, gemms)
        forward = [name for _, name in gemms if "transpose(" not in name and "pp_weight" not in name]
        assert forward and len(gemms) - len(forward) >= 2, (site, gemms)  # dX and dW (XLA may merge a site's)
    rest = {kind for kind, name in sites if not any(f"/{s}/" in name for s in SITES)}
    assert "fp8" not in rest  # attention scores and the output layer stay in the compute dtype


def test_fp8_gemms_write_the_compute_dtype_with_their_scale_fused():
    """cuBLASLt's fp8 GEMMs (forward, dX and dW of every projection) write bf16, the dtype the layer computes in,
    their power-of-two scale an operand of the call: no fp32 product followed by a scale and convert pass."""
    _, _, step = gpu_compile("debug", ["precision.preset=fp8"] + SMALL[1:], "1")
    calls = [line for line in step.as_text().splitlines() if 'custom_call_target="__cublas$lt$matmul$f8"' in line]
    outputs = [re.search(r"= \((\w+)\[", line).group(1) for line in calls]
    assert len(outputs) == 3 * len(SITES) and set(outputs) == {"bf16"}, outputs
    assert all(len(re.search(r"custom-call\(([^)]*)\)", line).group(1).split(",")) >= 3 for line in calls)  # + scales


def test_fp8_runs_the_experts_gemms_in_fp8_and_the_router_not():
    for routing in ("dropless", "capacity"):
        _, _, step = gpu_compile("mixtral-tiny", ["precision.preset=fp8", f"moe.routing={routing}"], "1")
        experts = [(kind, name) for kind, name in gemm_sites(step.as_text()) if "/experts/" in name]
        router = [kind for kind, name in experts if "/router/" in name]
        gemms = [(kind, name) for kind, name in experts if "/router/" not in name]
        assert router and "fp8" not in router
        assert all(kind == "fp8" for kind, _ in gemms), gemms
        forward = [name for _, name in gemms if "transpose(" not in name]
        assert len(forward) >= 2 and len(gemms) - len(forward) >= 4, (routing, gemms)


@pytest.mark.parametrize("receive_factor", [None, 1.0], ids=["uncapped", "share1"])
def test_dropless_experts_go_by_ragged_all_to_all_to_grouped_gemm_kernels(receive_factor):
    """mixtral-tiny at dp 8: each layer's dispatch and combine, and their transposes, are ragged all-to-alls; no
    all-to-all carries activations (only the receivers' offsets, integers). The experts' three GEMMs, forward, dX
    and dW, are tokamax's grouped kernels (Mosaic GPU on an H100), which read the group sizes at run time, so no
    XLA GEMM over the receive buffer is left. Counted at their buffers' rows (what the planner reads: a bound, as
    the kernels compute the routed rows), they are n x N x k rows uncapped, N x k at `moe.receive_factor=1.0`."""
    cap = [] if receive_factor is None else [f"moe.receive_factor={receive_factor}"]
    config, _, step = gpu_compile("mixtral-tiny", ["precision.preset=bf16", *cap], "dp8")
    text = step.as_text()
    runs = config.model.num_hidden_layers * config.train.grad_accum  # each layer, each micro-batch
    assert per_step(text, "ragged-all-to-all-start(") == 4 * runs
    for line in text.splitlines():
        if re.search(r"= \S+ all-to-all(-start)?\(", line):
            assert not re.search(r"\b(bf16|f32|f16)\[", line.split("all-to-all")[0]), line
    assert per_step(text, 'custom_call_target="mosaic_gpu') == 9 * runs
    layers = config.model.num_hidden_layers
    assert scoped_gemm_flops(text, "experts", grouped=False) == scoped_gemm_flops(text, "router")  # no XLA GEMM
    tc, mc = config.train, config.model
    routed = 9 * layers * tc.batch_size * tc.seq_len // 8 * mc.num_experts_per_tok * 2 * mc.hidden_size \
        * mc.intermediate_size  # 3 GEMMs x (forward, dX, dW) per routed row
    bound = scoped_gemm_flops(text, "experts") - scoped_gemm_flops(text, "router")
    assert bound / routed == pytest.approx(8.0 if receive_factor is None else 1.0, rel=1e-6)


def test_experts_over_ep_exchange_within_their_group_and_reduce_over_its_copies():
    """mixtral-tiny at dp 8, ep 4 for compile-only H100s: the ragged all-to-alls run within each group of 4
    consecutive devices, and the experts' gradients (2 layers x 2 experts x 3 weights a device) are all-reduced
    over the group's 2 copies only, devices 4 apart."""
    from pjax.observe.hlo import device_groups

    config, _, step = gpu_compile("mixtral-tiny", ["precision.preset=bf16", "mesh.ep=4"], "dp8-ep4")
    assert per_step(step.as_text(), "ragged-all-to-all-start(") == 4 * config.model.num_hidden_layers \
        * config.train.grad_accum
    text = step.as_text().splitlines()
    ragged = [line for line in text if "ragged-all-to-all-start(" in line]
    assert ragged and all(device_groups(line, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]] for line in ragged)
    mc = config.model
    experts = mc.num_hidden_layers * 2 * 3 * mc.hidden_size * mc.intermediate_size
    copies = [line for line in text if re.search(r"all-reduce(-start)?\(", line)
              and device_groups(line, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]]
    assert [_dims(line.split("=")[1].split()[0]) for line in copies] == [[experts]], copies


def test_the_grouped_gemm_is_tokamax_s_kernel_where_its_mosaic_lowers_and_xla_s_elsewhere():
    """Hopper, bf16 and widths in whole 128-byte swizzles: tokamax; a width of 48, fp32, an A100 or the CPU: XLA's."""
    import jax
    import jax.numpy as jnp

    from models import grouped_gemm

    x = lambda k, dtype=jnp.bfloat16: jax.ShapeDtypeStruct((256, k), dtype)  # noqa: E731
    w = lambda k, n: jax.ShapeDtypeStruct((4, k, n), jnp.bfloat16)  # noqa: E731
    with building_for("gpu", gpu_target.gpu_devices("h100", 1, 1)[0]):
        assert grouped_gemm.kernel(x(128), w(128, 192)) == "tokamax"
        assert grouped_gemm.kernel(x(128), w(128, 48)) == "xla"
        assert grouped_gemm.kernel(x(128, jnp.float32), w(128, 192)) == "xla"
    with building_for("gpu", gpu_target.gpu_devices("a100", 1, 1)[0]):
        assert grouped_gemm.kernel(x(128), w(128, 192)) == "xla"
    assert grouped_gemm.kernel(x(128), w(128, 192)) == "xla"  # this host's CPU


def test_pjax_s_options_overlap_the_collectives_with_compute():
    """With pjax's XLA:GPU options, dp8 ZeRO-1's gradient reduce-scatters and parameter all-gathers and dp2 x tp4
    with SP's collectives have computation scheduled between their start and done."""
    for layout in ("dp8-zero1", "dp2-tp4-sp"):
        _, trainer, step = gpu_compile("debug", WIDE, layout)
        assert trainer.xla_options == {k: v for k, v in xla_options.GPU_OPTIONS.items()}
        overlap = async_overlap(step.as_text())
        for kind in ("reduce-scatter", "all-gather"):
            row = overlap[kind]
            # measured 4/4, 7/7 (dp8) and 7/8 (SP); unscheduled, none overlaps (reasoned)
            assert row["overlapped"] >= 0.8 * row["sites"] and row["sites"] >= 3, (layout, overlap)


def test_a_streaming_landing_reduces_its_fragment_while_its_inner_step_runs():
    """dp8, H=4 in 2 fragments landing tau=1 step after their send: in the landing step every all-reduce of the
    fragment (each over 1M elements, the step's scalars apart) starts before the inner step's backward loop ends
    and is done after it (`pjax/parallel/overlap.py`, `xla_options.IN_FLIGHT`)."""
    overrides = [*WIDE, "train.local_steps=4", "train.diloco_fragments=2", "train.diloco_overlap=1",
                 "train.steps=8", "train.batch_size=8", "train.seq_len=64"]
    _, trainer, step = gpu_compile("debug", overrides, "dp8")
    assert trainer.xla_options[xla_options.IN_FLIGHT] > 1
    spans = async_spans(step.as_text())
    big = [(comp, between) for comp, result, between in spans if math.prod(_dims(result)) > 2 ** 20]
    landing = {comp for comp, _ in big}
    assert len(landing) == 1 and len(big) >= 4, spans  # the landing branch: the embedding, lm_head, the MLPs'
    assert all("while" in between for _, between in big), big
    scalars = [between for comp, result, between in spans if comp in landing and math.prod(_dims(result)) < 16]
    assert scalars and not any("while" in between for between in scalars)  # the loss, norm and lr: at the end


def _dims(result: str) -> list[int]:
    """The dimensions of an HLO result type's (first) array: f32[1,4096,11008]{2,1,0} -> [1, 4096, 11008]."""
    return [int(d) for d in re.search(r"\[([\d,]*)\]", result).group(1).split(",") if d]


def test_a_flag_the_user_sets_wins_and_the_key_turns_them_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true")
    with building_for("gpu"):
        mine = xla_options.step_options(True)
        assert "xla_gpu_enable_triton_gemm" not in mine and mine["xla_gpu_enable_pipelined_all_gather"]
        assert xla_options.step_options(False) == {}
        line = xla_options.describe(mine)
    assert xla_options.step_options(True) == {}  # XLA:CPU: none
    assert len(line.splitlines()) == 1 and "XLA_FLAGS steers xla_gpu_enable_triton_gemm" in line
    assert "--xla_gpu_enable_pipelined_all_gather=true" in line and "train.xla_options=false" in line
    with pytest.raises(ConfigError, match="train.xla_options"):
        load_config("debug", ["train.xla_options=maybe"])


def test_a_users_flag_wins_over_pjax_s_whole_family_of_options(monkeypatch):
    """Not only a flag of the same name: Triton's GEMM flags steer pjax's cuBLAS choice, the pipelined-collectives
    switch (and a later XLA's `xla_gpu_pipeline_*` modes) steer both pipelined kinds."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_triton_gemm_any=true --xla_gpu_enable_pipelined_collectives=false")
    with building_for("gpu"):
        mine = xla_options.step_options(True)
    assert not {"xla_gpu_enable_triton_gemm", "xla_gpu_enable_pipelined_all_gather",
                "xla_gpu_enable_pipelined_all_reduce"} & set(mine)
    assert mine["xla_gpu_all_gather_combine_threshold_bytes"] == 128 * 2**20  # another family: pjax's
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_pipeline_all_gather=off")
    assert xla_options.overridden() == {"xla_gpu_enable_pipelined_all_gather"}


def test_pjax_s_options_unroll_no_loop_without_a_collective():
    """One compile-only GPU, the layers scanned (a loop with no collective): the step pjax compiles is within 1.2x
    of XLA's defaults in size (forced double buffering made it 1.6x: every loop unrolled by two)."""
    overrides = ["train.scan_layers=true", "train.remat=none", "train.batch_size=4", "train.grad_accum=2"]
    size = {on: len(gpu_compile("debug", [*overrides, f"train.xla_options={str(on).lower()}"], "1")[2].as_text())
            for on in (True, False)}
    assert size[True] <= 1.2 * size[False], size


def test_the_planner_compiles_every_section_and_explains_kernels(capsys):
    assert plan_cli.main(["--config", "debug", "--devices", "1", "--device-kind", "h100", "--explain", "1-m2",
                          "precision.preset=fp8", "train.batch_size=4", "train.grad_accum=2"]) == 0
    out = capsys.readouterr().out
    assert "(fp8 precision, attention cudnn)" in out
    assert "attention: cuDNN's fused attention (4 forward and 4 backward calls per step)" in out
    gemms = re.search(r"GEMMs per step by operand dtype: fp8 (\d+) \(([\d.]+)% of the FLOPs\), bf16", out)
    assert gemms and int(gemms.group(1)) >= 2 * 2 * 4 * 3 and float(gemms.group(2)) > 0, out


def test_the_same_state_with_the_gpu_s_own_memory_plan(compiled):
    gpu, cpu = (compiled[b][i].memory_analysis() for b, i in (("gpu", 1), ("cpu", 2)))
    assert gpu.argument_size_in_bytes == cpu.argument_size_in_bytes  # parameters, moments, batch: the same shards
    assert gpu.temp_size_in_bytes > 0 and gpu.temp_size_in_bytes != cpu.temp_size_in_bytes


def test_the_planner_reads_collectives_per_axis_from_the_gpu_compile(compiled):
    trainer, step = compiled["gpu"]
    comm = step_collectives(compiled["config"], dict(trainer.mesh.shape), step.as_text(), 8)
    assert {"dp", "tp"} <= set(comm)
    assert "reduce-scatter" in comm["dp"]["kinds"]  # ZeRO-1: the gradient in dp slices


def test_the_planner_ranks_hsdp_above_flat_zero3_by_the_bytes_each_sends_across_hosts():
    """debug on 8 compile-only H100s, 4 per host, where the network decides (its compute is negligible): flat
    ZeRO-3's collectives all cross hosts; HSDP's groups of 4 keep them on NVLink and send across hosts the
    all-reduce of each group's shard of the fp32 gradient (a ring of 2 copies: 1/4 of it), at the network's rate."""
    config = load_config("debug", ["precision.preset=fp32"])  # bf16's presets reduce the layers' gradient in bf16
    found = {}
    for shard in (0, 4):
        layout = Layout(dp=8, zero=3, zero_shard=shard)
        compiled = compile_layout(config, layout, CUDNN_H100, 4, "gpu")
        found[shard] = compiled["comm"]["dp"], predict(
            planned_config(config, layout, CUDNN_H100), layout, CUDNN_H100, compiled["comm"],
            compiled["memory"]["total"], 0.75, StepMatmuls.from_json(compiled["matmuls"]))
    (flat, flat_step), (hsdp, hsdp_step) = found[0], found[4]
    assert flat["inter_link_bytes"] == flat["link_bytes"] > 0
    shard_of_gradient = reduced_gradient_bytes(config, Layout(dp=8)) / 4
    # and the loss's and the metrics' all-reduces over every replica, a few floats each: 903.5 link bytes measured
    assert shard_of_gradient <= hsdp["inter_link_bytes"] <= shard_of_gradient + 1024, hsdp
    # ZeRO-3's gathers and reduce-scatters stay inside a host: 4.77 times the bytes across, measured
    assert hsdp["link_bytes"] - hsdp["inter_link_bytes"] > 4 * hsdp["inter_link_bytes"]
    assert hsdp_step.terms["dp"] < flat_step.terms["dp"] and hsdp_step.step_s < flat_step.step_s


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
    for c in plan["compiled"]:  # cuDNN's attention compiles in every layout: no chunked fallback
        assert c["attention"] == "cudnn" and c["memory"]["total"] > c["memory"]["argument"]
        assert "train.attention=chunked" not in c["overrides"]
